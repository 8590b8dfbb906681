import sys

from streamrl.tools.cli import main

sys.exit(main())
