"""The wheel carries configs/ and workloads/ (top-level folders of the checkout) inside
the package as linepack/data/, so an installed linepack finds them (tools/resources.py).
Everything else is in setup.cfg."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
DATA_FOLDERS = ("configs", "workloads")      # tools/resources.py DATA_FOLDERS


class BuildWithData(build_py):
    def run(self):
        super().run()
        for sub in DATA_FOLDERS:
            self.copy_tree(os.path.join(HERE, sub), os.path.join(self.build_lib, "linepack", "data", sub))


setup(cmdclass={"build_py": BuildWithData})
