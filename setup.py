"""The one part of logbus that is compiled: send()'s common case in C (logbus/api/_fastsend.c).

Everything else about the package is in pyproject.toml. The extension is optional: where no C
compiler is found, the install goes on and send() runs in Python alone (the same behaviour, slower;
logbus.api.producer.FAST_PATH says which).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("logbus.api._fastsend", ["logbus/api/_fastsend.c"], optional=True)])
