"""Moved to ``minifer.course.kv_memory`` (a chapter's experiment, not a benchmark to run against any engine). This name
stays for the notebooks and commands that use it: importing it gives the course's module itself."""

import sys

from minifer.course import kv_memory as _moved

if __name__ == "__main__":
    sys.exit(_moved.main())
sys.modules[__name__] = _moved
