from agentbolt.cli import main

main()
