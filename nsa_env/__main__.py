import sys

from nsa_env.cli import main

sys.exit(main())
