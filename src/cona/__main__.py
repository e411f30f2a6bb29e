from cona.cli import main

raise SystemExit(main())
