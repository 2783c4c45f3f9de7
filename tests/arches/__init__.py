"""The facts of each architecture the tests need, one module per architecture
(conftest.py loads ARCH's as conftest.FACTS; ALL_ARCHES is this folder's modules):
a third architecture adds its module here and touches no test module."""
