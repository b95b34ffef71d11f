from agentbolt.cli.main import main

main()
