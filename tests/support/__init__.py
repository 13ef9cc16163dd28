"""What the test modules share: tiny models, real tokenizers, fakes, fault injection and builders of
managers, engines and CLI runs. No test lives here, and no test module imports another."""
