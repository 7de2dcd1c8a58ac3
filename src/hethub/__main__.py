from hethub.cli import main

raise SystemExit(main())
