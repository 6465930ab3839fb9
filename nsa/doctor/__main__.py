import sys

from nsa.doctor.cli import main

sys.exit(main())
