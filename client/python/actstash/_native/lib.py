"""The native library (libactstash.so, C ABI actstash/c_api.h) through ctypes.

One library serves every CPython version and any torch: it links neither. Two
handles on it: `_c` releases the GIL for the call (calls that may wait), `_py`
keeps it (calls that may hand Python references back and forth: the engine
acquires and releases owner references with Py_IncRef/Py_DecRef only inside
those).
"""
import ctypes
import json
import os

from actstash._errors import (StashError, StashFull, StashInvalidArgument,  # noqa: F401
                              StashNotFound, StashUnavailable)

# The package's folder (this module is in a subpackage of it).
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PATH = os.environ.get("ACTSTASH_LIBRARY") or os.path.join(_HERE, "libactstash.so")


_INVALID_ARGUMENT, _NOT_FOUND, _RESOURCE_EXHAUSTED, _FAILED_PRECONDITION = 3, 5, 8, 9
_UNAVAILABLE, _DEADLINE_EXCEEDED = 14, 4

try:
    _c = ctypes.CDLL(_PATH)
    _py = ctypes.PyDLL(_PATH)
except OSError as error:  # pragma: no cover - a broken installation
    raise ImportError(f"actstash: cannot load its native library {_PATH}: {error}") from None

_u64, _i64, _int, _vp = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_obj = ctypes.py_object


def _declare(lib, name, restype, *argtypes):
    fn = getattr(lib, "actstash_" + name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


_C_API_VERSION = 8  # settings JSON, describe_json, copy_share, reserve/park/locate, adamw_step*
if _declare(_c, "c_api_version", _int)() != _C_API_VERSION:
    raise ImportError(f"actstash: {_PATH} has C API version {_c.actstash_c_api_version()}, "
                      f"this package needs {_C_API_VERSION} (mixed installs?)")
_last_error = _declare(_py, "last_error", ctypes.c_char_p)
_free_string = _declare(_c, "free_string", None, _vp)
cuda_available_fn = _declare(_c, "cuda_available", _int)
_describe_json = _declare(_c, "describe_json", _vp)
_parse_size = _declare(_c, "parse_size", _int, ctypes.c_char_p, _u64, ctypes.POINTER(_u64))
client_connect = _declare(_c, "client_connect", _int, ctypes.c_char_p, ctypes.POINTER(_vp))
client_close = _declare(_c, "client_close", _int, _vp)
client_free = _declare(_c, "client_free", None, _vp)
client_info_json = _declare(_c, "client_info_json", _vp, _vp)
client_stats_json = _declare(_c, "client_stats_json", _int, _vp, _int, ctypes.POINTER(_vp))
client_copy_share_json = _declare(_c, "client_copy_share_json", _int, _vp, ctypes.c_double,
                                  ctypes.c_double, ctypes.POINTER(_vp))
client_reserve = _declare(_c, "client_reserve", _int, _vp, _u64, ctypes.POINTER(_u64),
                          ctypes.POINTER(ctypes.c_size_t))
client_release = _declare(_c, "client_release", _int, _vp, _u64, _u64)
client_park = _declare(_c, "client_park", _int, _vp, _u64)
client_locate = _declare(_c, "client_locate", _int, _vp, _u64, ctypes.POINTER(ctypes.c_size_t))
_d = ctypes.c_double
_u64p = ctypes.POINTER(_u64)
_uptrp = ctypes.POINTER(ctypes.c_size_t)
# The GIL is released while it runs (CDLL).
adamw_step = _declare(_c, "adamw_step", _int, _u64, _uptrp, _uptrp, _uptrp, _uptrp, _u64p, _d,
                      _d, _d, _d, _d, _u64, _int)
adamw_step_bf16 = _declare(_c, "adamw_step_bf16", _int, _u64, _uptrp, _uptrp, _uptrp, _uptrp,
                           _uptrp, _u64p, _d, _d, _d, _d, _d, _u64, _int)


class EngineCallbacks(ctypes.Structure):
    """actstash_engine_callbacks: function addresses (or None)."""
    _fields_ = [("acquire", _vp), ("release", _vp), ("unlock", _vp), ("relock", _vp)]


engine_create = _declare(_c, "engine_create", _int, _vp, ctypes.c_char_p,
                         ctypes.POINTER(EngineCallbacks), ctypes.POINTER(_vp))
engine_settings_json = _declare(_c, "engine_settings_json", _vp, _vp)
engine_free = _declare(_py, "engine_free", None, _vp)  # releases owners: the GIL is held
engine_pack = _declare(_py, "engine_pack", _u64, _vp, _u64, _u64, _u64, _vp, _vp, _u64, _u64,
                       _obj, _obj, _u64)
engine_pack_dense_cpu = _declare(_py, "engine_pack_dense_cpu", _u64, _vp, _u64, _u64, _u64, _u64,
                                 _obj, _obj)
engine_unpack = _declare(_py, "engine_unpack", _int, _vp, _u64, _u64, _vp, _int)
engine_unpack_into = _declare(_py, "engine_unpack_into", _int, _vp, _u64, _u64, _u64, _u64, _vp,
                              _int)
engine_fetch_into = _declare(_c, "engine_fetch_into", _int, _vp, _u64, _u64, _u64, _u64)
engine_prefetch = _declare(_py, "engine_prefetch", _int, _vp, _u64, _u64, _u64, _obj, _u64)
engine_finish = _declare(_c, "engine_finish", _int, _vp, _u64, _u64)
engine_view_done = _declare(_py, "engine_view_done", None, _vp, _u64)
engine_release = _declare(_py, "engine_release", None, _vp, _u64)
engine_reap = _declare(_py, "engine_reap", _int, _vp, _int)
engine_take_error = _declare(_py, "engine_take_error", _int, _vp)
engine_take_notice = _declare(_py, "engine_take_notice", _int, _vp)
engine_wait = _declare(_c, "engine_wait", None, _vp)  # GIL released; releases no owner
engine_available = _declare(_py, "engine_available", _int, _vp)
engine_stats = _declare(_py, "engine_stats", _int, _vp, _vp, _int)

# Owner references: Python objects, counted with the interpreter's own functions.
_pyapi = ctypes.pythonapi
PY_INCREF = ctypes.cast(_pyapi.Py_IncRef, _vp).value
PY_DECREF = ctypes.cast(_pyapi.Py_DecRef, _vp).value
# The engine lets the GIL go while engine_pack waits for copies (the in-flight
# bound): engine_pack is called with it held (PyDLL), so these are safe there.
PY_SAVE_THREAD = ctypes.cast(_pyapi.PyEval_SaveThread, _vp).value
PY_RESTORE_THREAD = ctypes.cast(_pyapi.PyEval_RestoreThread, _vp).value
_decref = _pyapi.Py_DecRef
_decref.argtypes = [_vp]
_decref.restype = None


def take_object(address):
    """The object at `address` whose reference the engine handed over."""
    obj = ctypes.cast(address, _obj).value  # a new reference
    _decref(address)                         # the one handed over
    return obj


def last_error_text():
    """The message of the last failed call on this thread."""
    return _last_error().decode(errors="replace")


def raise_for(code, context=""):
    """Raises the exception for a non-zero status code of the last call."""
    message = _last_error().decode(errors="replace")
    if context:
        message = f"{context}: {message}"
    if code in (_UNAVAILABLE, _DEADLINE_EXCEEDED):
        raise StashUnavailable(message)
    if code == _RESOURCE_EXHAUSTED:
        raise StashFull(message)
    if code == _NOT_FOUND:
        raise StashNotFound(message)
    if code == _INVALID_ARGUMENT:
        raise StashInvalidArgument(message)
    raise StashError(message)


def error_for(code):
    try:
        raise_for(code)
    except StashError as error:
        return error
    return None


def cuda_available():
    """Whether this build has CUDA and a device can be used."""
    return bool(cuda_available_fn())


def _string(address):
    try:
        return ctypes.string_at(address).decode()
    finally:
        _free_string(address)


# What the native library says of itself (actstash_describe_json): the pack flags,
# unpack kinds, keep reasons, counter names and every setting with its default. Read
# here instead of re-declared, so that the package and the library cannot disagree.
DESCRIPTION = json.loads(_string(_describe_json()))
STAT_NAMES = tuple(DESCRIPTION["engine_stats"])
CLIENT_DEFAULTS = DESCRIPTION["client_options"]
ENGINE_DEFAULTS = DESCRIPTION["engine_options"]
# Saved tensors below this stay in the trainer unless a scope says otherwise.
DEFAULT_MIN_BYTES = DESCRIPTION["default_min_bytes"]


def parse_size(text, percent_base=0, what=None):
    """Bytes of a size as the daemon reads it: '6GiB', '4G', '512 MiB' (binary), '1.5GB'
    (decimal), a number of bytes, or '25%' of percent_base. ValueError otherwise, its
    message starting with `what` (the setting's name) when given."""
    prefix = f"{what}: " if what else ""
    if isinstance(text, bool) or (isinstance(text, int) and text < 0):
        raise ValueError(f"{prefix}not a byte size: {text!r}")
    if isinstance(text, int):
        return text
    out = _u64()
    code = _parse_size(str(text).encode(), int(percent_base), ctypes.byref(out))
    if code:
        raise_for(code, what)
    return out.value


def settings_json(settings):
    """A settings dict as the JSON object the C ABI reads (names checked natively)."""
    return json.dumps(settings).encode()


def engine_settings(handle):
    """The settings an engine runs with (actstash_engine_settings_json)."""
    return json.loads(_string(engine_settings_json(handle)))


class Client:
    """A session with actstashd (actstash::Client). Thread-safe.

    settings: ClientOptions by the names of CLIENT_DEFAULTS (address, client_name,
    quota_bytes, attach, pin_leases, rpc_timeout_ms, spill, lease_retain_ms, ...); an
    unknown name or a bad value is a ValueError naming it."""

    def __init__(self, **settings):
        handle = _vp()
        code = client_connect(settings_json(settings), ctypes.byref(handle))
        if code:
            raise_for(code)
        self._handle = handle.value
        self.closed = False  # close() was called

    @property
    def handle(self):
        return self._handle

    def info(self):
        """The session as the native client describes it (client_info_json)."""
        if self._handle is None:
            raise StashError("the session is closed")
        return json.loads(_string(client_info_json(self._handle)))

    attached = property(lambda self: self.info()["attached"])
    attach_error = property(lambda self: self.info()["attach_error"])
    # The daemon has a spill tier and this session may use it (attached, spill=True).
    can_spill = property(lambda self: self.info()["can_spill"])
    session_id = property(lambda self: self.info()["session_id"])
    quota = property(lambda self: self.info()["quota"])
    address = property(lambda self: self.info()["address"])
    pin_error = property(lambda self: self.info()["pin_error"])

    def device_pools(self):
        return self.info()["device_pools"]

    def zero_copy_usage(self):
        return self.info()["zero_copy"]

    def stats(self, all_sessions=False):
        """The daemon's counters as a dict of the StatsReply message (actstash/v1/stash.proto):
        "pool", "sessions", "objects", "self" (this session; its "client" is what this client
        reported, its "spill" the daemon's spill counts, None without a spill tier) and, when
        asked, "all_sessions"."""
        if self._handle is None:
            raise StashError("the session is closed")
        out = _vp()
        code = client_stats_json(self._handle, int(bool(all_sessions)), ctypes.byref(out))
        if code:
            raise_for(code)
        return json.loads(_string(out.value))

    def copy_share(self, probe_store_bps=0.0, probe_fetch_bps=0.0):
        """The node's copy bandwidth and this session's share, a dict of the CopyShareReply
        message: "node" (node_bytes_per_second, node_source, copying_sessions,
        window_seconds) and "share_bytes_per_second" (0: unknown). Asking counts this session
        as copying."""
        if self._handle is None:
            raise StashError("the session is closed")
        out = _vp()
        code = client_copy_share_json(self._handle, float(probe_store_bps), float(probe_fetch_bps),
                                      ctypes.byref(out))
        if code:
            raise_for(code)
        return json.loads(_string(out.value))

    def reserve(self, nbytes):
        """A long-lived buffer of nbytes in the session's leased pool memory (never
        spilled unless parked): (ticket, address). StashError when not attached; StashFull
        past the quota or the pool."""
        if self._handle is None:
            raise StashError("the session is closed")
        ticket, address = _u64(), ctypes.c_size_t()
        code = client_reserve(self._handle, int(nbytes), ctypes.byref(ticket),
                              ctypes.byref(address))
        if code:
            raise_for(code)
        return ticket.value, address.value

    def park(self, ticket):
        """The caller keeps no pointer into a reserve()d buffer any more: under pool
        pressure it may go to the daemon's disk. locate() finds it again."""
        if self._handle is None:
            raise StashError("the session is closed")
        code = client_park(self._handle, int(ticket))
        if code:
            raise_for(code)

    def locate(self, ticket):
        """A reserve()d buffer's address now (read back first when it was spilled), valid
        until the next park() or release()."""
        if self._handle is None:
            raise StashError("the session is closed")
        address = ctypes.c_size_t()
        code = client_locate(self._handle, int(ticket), ctypes.byref(address))
        if code:
            raise_for(code)
        return address.value

    def release(self, ticket, nbytes):
        """Gives a reserve()d buffer back."""
        if self._handle is None:
            return
        code = client_release(self._handle, int(ticket), int(nbytes))
        if code:
            raise_for(code)

    def close(self):
        """Ends the session (what it stored goes back to the daemon)."""
        self.closed = True
        if self._handle is not None:
            code = client_close(self._handle)
            if code:
                raise_for(code)

    def __del__(self):
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None:
            try:
                client_free(handle)
            except Exception:  # interpreter shutdown
                pass
