from fleetgate.cli import main

raise SystemExit(main())
