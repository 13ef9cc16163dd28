from kvchat.cli.app import main

main()
