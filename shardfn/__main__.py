"""``python -m shardfn [--no-check] [--world N]``: versions, backends, devices, self-check.

See :mod:`shardfn._selfcheck`.
"""

import sys

from shardfn._selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
