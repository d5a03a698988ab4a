from supervisor.entry import main

main()
