"""The facts of each architecture the tests need, one module per architecture
(conftest.py loads ARCH's as conftest.FACTS, every one's as ALL_FACTS; ALL_ARCHES is this
folder's modules): a new architecture adds its module here, with the same names as
x86_64.py, and edits no test module (tests/test_arch.py checks both)."""
