import sys

from ppdsl.cli import main

sys.exit(main())
