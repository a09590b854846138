# The version of kvxfer.h (KVX_VERSION_STRING) this package binds; a test
# checks the two agree.
__version__ = "3.2.0"
