import sys

from nsa_env.doctor.cli import main

sys.exit(main())
