import sys

from pic.cli import main

sys.exit(main())
