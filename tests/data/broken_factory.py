"""A factory module that does not import (tests/calibrate/test_models.py)."""

import a_module_that_does_not_exist  # noqa: F401
