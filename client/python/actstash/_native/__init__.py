"""The native library (libactstash.so, the C API of client/capi) through ctypes:
module `lib` is this part's interface; it links neither Python nor torch."""
