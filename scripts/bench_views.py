"""What the cache views cost, side by side in one run: one `/infer`, then `/attention` on its answer,
`/compare exact reposition repair` and `/blocks`, then the same `/infer` again, through the
ContextManager the REPL drives, on one context (a system prompt, seven passages, a query).

    python scripts/bench_views.py --dtype bf16 --threads 1 --tokens 64 --repeats 3

A first `/infer` warms the session (its chunks' KV is then cached, as in a REPL after the first answer);
each repeat runs the five steps in turn. The table shows each step's median seconds and the median of
each repeat's ratio to that repeat's first `/infer`, and the decode tokens/s of the `/infer` before and
after the views: the views run outside the decode loop, so the second must decode as fast as the first.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from bench_common import machine, model_parser

from kvchat.chunks.attention import attention_map
from kvchat.chunks.blockmap import cache_map
from kvchat.chunks.compare import compare_modes
from kvchat.chunks.context import ContextManager
from kvchat.chunks.types import ReuseMode
from kvchat.config import load_settings
from kvchat.engine.sampling import SamplingParams
from kvchat.session import open_session

SYSTEM = "You are a careful assistant. Answer from the passages below; say so when they do not tell."
PASSAGES = [
    "The Rhine rises in the Swiss Alps, in the canton of Graubünden, and flows north through Lake "
    "Constance, then west along the Swiss-German border to Basel. From there it turns north again, "
    "forming the border between Germany and France, and passes through the Rhine Gorge, where castles "
    "stand on the cliffs above the water. Below Bonn the valley widens; the river crosses the industrial "
    "Ruhr region and enters the Netherlands, where it splits into several branches, the Waal carrying "
    "most of its water, before reaching the North Sea near Rotterdam. It is about 1,230 kilometres long "
    "and has carried barges, timber and wine for two thousand years.",
    "The Danube rises in the Black Forest in Germany, where two small streams, the Brigach and the Breg, "
    "meet at Donaueschingen. It flows east through ten countries, more than any other river in the world: "
    "Germany, Austria, Slovakia, Hungary, Croatia, Serbia, Romania, Bulgaria, Moldova and Ukraine. Four "
    "capital cities stand on its banks: Vienna, Bratislava, Budapest and Belgrade. At the Iron Gates it "
    "cuts a deep gorge through the Carpathian mountains, and it ends in a wide delta of reeds, lakes and "
    "channels on the Black Sea, home to more than three hundred species of birds.",
    "The Loire is the longest river entirely in France, about 1,000 kilometres from its source on Mont "
    "Gerbier de Jonc in the Massif Central to its mouth at Saint-Nazaire on the Atlantic. Its middle "
    "valley, between Sully-sur-Loire and Chalonnes, is known for its châteaux, built by kings and nobles "
    "from the fifteenth century onwards: Chambord, Blois, Amboise and Chenonceau among them. The river is "
    "shallow and changes its sandbanks with every flood, so it was never an easy waterway; flat-bottomed "
    "boats carried salt, wine and slate along it until the railway came in the nineteenth century.",
    "The Thames flows about 346 kilometres from the Cotswold hills to the North Sea, through Oxford, "
    "Reading, Windsor and London. Its lower reaches are tidal up to Teddington Lock, and for centuries "
    "the Pool of London was one of the busiest ports in the world. In the summer of 1858 the smell of the "
    "sewage in the river was so bad that Parliament voted money for new sewers, built by Joseph "
    "Bazalgette, which still carry much of the city's waste. The Thames Barrier, opened in 1984, closes "
    "against storm surges from the sea and protects the city from floods.",
    "The Nile flows north for about 6,650 kilometres from the lakes of East Africa to the Mediterranean. "
    "Its two great branches meet at Khartoum: the White Nile, which leaves Lake Victoria, carries a steady "
    "flow all year, while the Blue Nile, from Lake Tana in the Ethiopian highlands, brings most of the "
    "water and the silt in the summer rains. For thousands of years the yearly flood spread that silt over "
    "the fields of Egypt, and the farmers' calendar followed it. Since the Aswan High Dam was finished in "
    "1970 the flood has been held back in Lake Nasser, and the river below the dam runs at an even level.",
    "The Amazon carries more water than any other river, about a fifth of all the fresh water that rivers "
    "pour into the oceans. It rises in the Andes of Peru, a few hundred kilometres from the Pacific, and "
    "crosses the whole continent to the Atlantic, gathering more than a thousand tributaries, seventeen of "
    "them longer than 1,500 kilometres. No bridge crosses it. In the rainy season its level rises by ten "
    "metres or more and the forest along its banks stands in water for months; at its mouth the river is "
    "so wide and so strong that ships find fresh water far out at sea, out of sight of land.",
    "The Mississippi rises at Lake Itasca in Minnesota, a stream small enough to wade across, and flows "
    "south for about 3,700 kilometres to the Gulf of Mexico below New Orleans. The Missouri joins it above "
    "St. Louis and the Ohio at Cairo, Illinois, and together they drain most of the land between the "
    "Rocky Mountains and the Appalachians. Steamboats made it the great road of the young United States, "
    "and Mark Twain, who piloted them as a young man, wrote about its towns and its shifting channels. "
    "Levees now line much of its lower course, and locks and dams hold its upper reaches for barges.",
]
QUERY = "Compare the rivers: where each rises, where it ends, and what it is known for."
MODES = [ReuseMode.EXACT, ReuseMode.REPOSITION, ReuseMode.REPAIR]


def session(args) -> ContextManager:
    model = {"dtype": args.dtype, "threads": args.threads} | ({"model": args.model} if args.model else {})
    cm = open_session(load_settings(None, {"model": model}))
    cm.set_system(SYSTEM)
    for passage in PASSAGES:
        cm.add_context(passage)
    cm.set_query(QUERY)
    return cm


def timed(step: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = step()
    return time.perf_counter() - start, result


def repeat(cm: ContextManager, params: SamplingParams) -> dict[str, float]:
    """One repeat's seconds per step, and the two `/infer`s' decode tokens/s."""
    row: dict[str, float] = {}
    row["/infer"], first = timed(lambda: cm.infer_blocking(params))
    row["/attention"], _ = timed(lambda: attention_map(cm))
    row["/compare exact reposition repair"], _ = timed(lambda: compare_modes(cm, MODES, params))
    row["/blocks"], _ = timed(lambda: cache_map(cm))
    row["/infer after the views"], second = timed(lambda: cm.infer_blocking(params))
    row["decode before"], row["decode after"] = first.decode_tok_s, second.decode_tok_s
    for result in (first, second):  # outputs not in the context; deleting them keeps the pool alike
        cm.delete_output(result.output_number)
    return row


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(machine())
    cm = session(args)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0)
    warm = cm.infer_blocking(params)
    cm.delete_output(warm.output_number)
    context = sum(len(c.token_ids) for c in cm.context_chunks())
    rows = [repeat(cm, params) for _ in range(args.repeats)]
    print(
        f"model={cm.model_id} dtype={args.dtype} threads={args.threads} context={context} tokens "
        f"generated={len(warm.token_ids)} x{args.repeats}"
    )
    print("| step | median s | vs /infer (median of paired ratios) |")
    print("|---|---:|---:|")
    for name in [k for k in rows[0] if not k.startswith("decode")]:
        med = statistics.median(r[name] for r in rows)
        ratio = statistics.median(r[name] / r["/infer"] for r in rows)
        print(f"| {name} | {med:#.3g} | {ratio:#.3g}x |")
    before = statistics.median(r["decode before"] for r in rows)
    after = statistics.median(r["decode after"] for r in rows)
    ratio = statistics.median(r["decode after"] / r["decode before"] for r in rows)
    print(f"| decode tok/s, /infer before → after the views | {before:.1f} → {after:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
