"""expseg from Python: PyTorch and CuPy on expseg, stats, snapshots and OOM reports (ctypes only).

    import expseg                                  # this file: tools/expseg.py
    expseg.install_torch("backend:expandable")     # first thing, before any CUDA tensor exists
    expseg.install_cupy("backend:expandable")      # or CuPy (before its first allocation)
    print(expseg.stats()["reserved_bytes.all.peak"], expseg.oom_report())

The library is found through $EXPSEG_LIBRARY (a path to libexpseg.so), else <repo>/build/lib/libexpseg.so
(built with `meson setup build && ninja -C build`), else the system library path. Configuration strings use
EXPSEG_ALLOC_CONF's syntax and are applied over it. Every failure raises ExpsegError with expseg's message.
"""
import array
import ctypes
import ctypes.util
import json
import operator
import os
import socket
import struct
import sys
import threading
import weakref

__all__ = [
    "ExpsegError", "library_path", "load", "version", "configure", "config", "install_torch", "install_cupy",
    "stats", "snapshot", "oom_report", "oom_report_json", "on_oom", "release_cached", "release_stream", "set_limit",
    "get_limit",
    "reset_peak_stats", "reset_accumulated_stats", "record_start", "record_stop", "record_write", "record_partial", "torch_memory_stats",
    "torch_snapshot", "initialized_devices", "enable_peer_access", "ipc_export", "ipc_import", "ipc_close",
    "ipc_send", "ipc_recv", "torch_oom_error",
]

# expseg_status (include/expseg/expseg.h)
SUCCESS, INVALID_ARGUMENT, INVALID_DEVICE, CONFIG, ALREADY_INITIALIZED, OUT_OF_MEMORY, INVALID_POINTER, DRIVER, IO, INTERNAL, \
    IPC = range(11)
MAX_DEVICES = 64  # EXPSEG_MAX_DEVICES
_CODE_NAMES = ["SUCCESS", "INVALID_ARGUMENT", "INVALID_DEVICE", "CONFIG", "ALREADY_INITIALIZED", "OUT_OF_MEMORY",
               "INVALID_POINTER", "DRIVER", "IO", "INTERNAL", "IPC"]

_lib = None
_lib_path = None
_torch_allocator = None  # kept alive for the life of the process (PyTorch holds only raw function pointers)
_torch_conf = None
_torch_oom_error = None  # the exception class an OOM raises under install_torch (torch_oom_error())
_cupy_allocator = None
_cupy_conf = None
_torch_pool_ids = {}  # expseg graph pool number -> PyTorch's pool id (a, b), for snapshots' segment_pool_id
_history_max_entries = 0  # torch.cuda.memory._record_memory_history's bound on trace entries (0: none)


class ExpsegError(RuntimeError):
    """An expseg call failed; .code is the expseg_status code (e.g. expseg.CONFIG)."""

    def __init__(self, message, code=INTERNAL):
        super().__init__(message)
        self.code = code


def _found_by_loader(name):
    """The name to load lib<name>.so by where the system's loader finds it: an installed soname (e.g.
    "libexpseg.so.0"), or "lib<name>.so" on LD_LIBRARY_PATH (find_library does not always look there); None."""
    found = ctypes.util.find_library(name)
    if found:
        return found
    try:
        ctypes.CDLL("lib%s.so" % name)
        return "lib%s.so" % name
    except OSError:
        return None


def library_path():
    """The path of libexpseg.so that load() uses ($EXPSEG_LIBRARY, <repo>/build/lib, or the system path)."""
    env = os.environ.get("EXPSEG_LIBRARY")
    if env:
        if not os.path.isfile(env):
            raise ExpsegError("EXPSEG_LIBRARY=%r: no such file (point it at libexpseg.so)" % env, INVALID_ARGUMENT)
        return os.path.abspath(env)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    built = os.path.join(repo, "build", "lib", "libexpseg.so")
    if os.path.isfile(built):
        return built
    found = _found_by_loader("expseg")
    if found:
        return found
    if os.path.isfile(os.path.join(repo, "meson.build")):
        build = ("build it there: `meson setup build && ninja -C build` in %s (or tools/study.sh, tools/build.sh) gives "
                 "%s; a build in another directory: EXPSEG_LIBRARY=BUILD_DIR/lib/libexpseg.so" % (repo, built))
    else:
        build = ("%s is not an expseg checkout (this expseg.py was copied out of one): point EXPSEG_LIBRARY at "
                 "BUILD_DIR/lib/libexpseg.so of an expseg build" % repo)
    raise ExpsegError(
        "libexpseg.so not found. Looked for: $EXPSEG_LIBRARY (unset), %s (no such file), the system library path "
        "(ldconfig's, LD_LIBRARY_PATH; after `meson install`). Set EXPSEG_LIBRARY=/path/to/libexpseg.so, or %s"
        % (built, build), INVALID_ARGUMENT)


# void (*)(int device, const char* report_json, void* user_data)
_OOM_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_oom_callback = None  # the ctypes function object expseg holds
# Every callback object ever installed, kept for the life of the process: a call already running on
# another thread when on_oom replaces it still needs its code (expseg_set_oom_callback does not wait).
_oom_callbacks_installed = []


def _declare(lib):
    c_int, c_size_t, c_ssize_t, c_void_p, c_char_p = ctypes.c_int, ctypes.c_size_t, ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_char_p
    sigs = {
        "expseg_malloc": (c_void_p, [c_ssize_t, c_int, c_void_p]),
        "expseg_free": (None, [c_void_p, c_ssize_t, c_int, c_void_p]),
        "expseg_cupy_malloc": (c_void_p, [c_void_p, c_size_t, c_int]),
        "expseg_cupy_free": (None, [c_void_p, c_void_p, c_int]),
        "expseg_record_stream": (c_int, [c_void_p, c_int, c_void_p]),
        "expseg_configure": (c_int, [c_char_p]),
        "expseg_config": (c_char_p, [c_int]),
        "expseg_device_initialized": (c_int, [c_int]),
        "expseg_release_cached": (c_int, [c_int]),
        "expseg_release_stream": (c_int, [c_int, c_void_p]),
        "expseg_set_limit": (c_int, [c_int, c_size_t]),
        "expseg_get_limit": (c_int, [c_int, ctypes.POINTER(c_size_t), ctypes.POINTER(c_size_t)]),
        "expseg_reset_peak_stats": (c_int, [c_int]),
        "expseg_reset_accumulated_stats": (c_int, [c_int]),
        "expseg_stats_json": (c_char_p, [c_int]),
        "expseg_snapshot_json": (c_char_p, [c_int]),
        "expseg_last_oom_report": (c_char_p, [c_int]),
        "expseg_last_oom_report_json": (c_char_p, [c_int]),
        "expseg_thread_oom_report": (c_char_p, [c_int]),
        "expseg_thread_oom_report_json": (c_char_p, [c_int]),
        "expseg_record_start": (c_int, [c_int, c_size_t]),
        "expseg_record_stop": (c_int, [c_int]),
        "expseg_set_record_default": (c_int, [c_int, c_size_t]),
        "expseg_record_write": (c_int, [c_int, c_char_p]),
        "expseg_record_partial": (c_int, [c_int, ctypes.POINTER(c_int)]),
        "expseg_snapshot_json_with_trace": (c_char_p, [c_int, c_char_p]),
        "expseg_last_error": (c_char_p, []),
        "expseg_last_error_code": (c_int, []),
        "expseg_clear_error": (None, []),
        "expseg_version": (c_char_p, []),
        "expseg_set_oom_callback": (c_int, [_OOM_CALLBACK, c_void_p]),
        "expseg_enable_peer_access": (c_int, [c_int, c_int]),
        "expseg_ipc_export": (c_int, [c_void_p, c_int, ctypes.POINTER(c_void_p), ctypes.POINTER(c_size_t),
                                      ctypes.POINTER(ctypes.POINTER(c_int)), ctypes.POINTER(c_size_t)]),
        "expseg_ipc_import": (c_int, [c_char_p, c_size_t, ctypes.POINTER(c_int), c_size_t, c_int,
                                      ctypes.POINTER(c_void_p), ctypes.POINTER(c_size_t)]),
        "expseg_ipc_close": (c_int, [c_void_p, c_int]),
        "expseg_begin_graph_pool": (c_int, [c_int, ctypes.c_ulonglong, c_void_p]),
        "expseg_prepare_capture": (c_int, [c_int, c_void_p]),
        "expseg_end_graph_pool": (c_int, [c_int, ctypes.c_ulonglong]),
        "expseg_release_graph_pool": (c_int, [c_int, ctypes.c_ulonglong]),
        "expseg_begin_pool_allocations": (c_int, [c_int, ctypes.c_ulonglong, c_void_p]),
        "expseg_end_pool_allocations": (c_int, [c_int, ctypes.c_ulonglong, c_void_p]),
        "expseg_restore_graph_pool_block": (c_int, [c_int, ctypes.c_ulonglong, c_void_p, c_size_t]),
        "expseg_graph_pool_blocks": (c_int, [c_int, ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_ulonglong),
                                             ctypes.POINTER(c_size_t), c_size_t, ctypes.POINTER(c_size_t)]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)  # AttributeError here: an old or foreign libexpseg.so
        fn.restype = restype
        fn.argtypes = argtypes


def load():
    """The ctypes handle of libexpseg.so (loaded once; the C functions are declared with their types)."""
    global _lib, _lib_path
    if _lib is None:
        path = library_path()
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise ExpsegError("cannot load %s: %s" % (path, e), INVALID_ARGUMENT) from e
        try:
            _declare(lib)
        except AttributeError as e:
            raise ExpsegError("%s is not a libexpseg.so with the C API (%s)" % (path, e), INVALID_ARGUMENT) from e
        _lib, _lib_path = lib, path
    return _lib


# What a machine without a usable GPU can do instead, said when the CUDA driver cannot be loaded or finds no device.
_NO_GPU_HINT = ("no GPU? use device:sim, the simulated device: EXPSEG_ALLOC_CONF=device:sim, or expseg.configure(\"device:sim\") "
                "before the first allocation")


def _error(what):
    lib = load()
    msg = (lib.expseg_last_error() or b"").decode("utf-8", "replace")
    code = lib.expseg_last_error_code()
    if code == DRIVER and ("cannot load the CUDA driver library" in msg or "CUDA_ERROR_NO_DEVICE" in msg):
        # The library's message says it for the environment variable; an older library's does not.
        msg += (" (from Python: expseg.configure(\"device:sim\") before the first allocation)" if "device:sim" in msg
                else " (%s)" % _NO_GPU_HINT)
    return ExpsegError(msg or ("%s failed" % what), code)


def _import(module, who, what, install):
    """`import module` for install_torch / install_cupy: a missing package is an ExpsegError that says so."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ExpsegError("expseg.%s: %s is not installed in this Python (%s: %s). Install it (%s), or use expseg without "
                          "it: the C++ or C API, the expseg command, or this module's other functions"
                          % (who, what, sys.executable, e, install), INVALID_ARGUMENT) from e


def _check(rc, what):
    if rc != SUCCESS:
        err = _error(what)
        err.code = rc
        raise err


def _text(ptr, what):
    if ptr is None:
        raise _error(what)
    return ptr.decode("utf-8", "replace")


def _device(device):
    """A device index as the C API takes it, from what PyTorch accepts as a CUDA device: an int (numpy's too),
    "cuda" / "cuda:N", a torch.device, or None for the current device. Range-checked: ctypes would wrap an
    out-of-range int into another device."""
    given = device
    if device is None or device == "cuda":
        torch = sys.modules.get("torch")
        started = torch is not None and getattr(torch.cuda, "is_initialized", lambda: False)()
        cupy = sys.modules.get("cupy")
        if started:
            device = torch.cuda.current_device()
        elif cupy is not None and hasattr(cupy, "cuda"):  # CuPy's current device (Device(n).use())
            device = cupy.cuda.runtime.getDevice()
        else:
            device = 0
    elif isinstance(device, str):
        # ASCII digits only: str.isdigit() also takes "²" (which int() refuses) and "٣" (which it reads as 3).
        if not device.startswith("cuda:") or not (device[5:].isascii() and device[5:].isdigit()):
            raise ExpsegError("device %r is not a CUDA device (expected an index, 'cuda' or 'cuda:N')" % (device,),
                              INVALID_DEVICE)
        device = int(device[5:])
    elif hasattr(device, "type") and hasattr(device, "index"):  # torch.device
        if device.type != "cuda":
            raise ExpsegError("device %r is not a CUDA device" % (device,), INVALID_DEVICE)
        return _device(device.index)
    if isinstance(device, bool):
        raise ExpsegError("device %r is not a device index" % (given,), INVALID_DEVICE)
    try:
        device = operator.index(device)
    except TypeError:
        raise ExpsegError("device %r is not a device index (expected an int, 'cuda:N', a torch.device or None)"
                          % (given,), INVALID_DEVICE) from None
    if not 0 <= device < MAX_DEVICES:
        raise ExpsegError("device %r is out of range (0 .. %d)" % (given, MAX_DEVICES - 1), INVALID_DEVICE)
    return device


def _size(n, what):
    """A size_t argument: ctypes would wrap a negative or too large int around (set_limit(-1): no limit)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 1 << 64:
        raise ExpsegError("%s must be an integer from 0 to 2**64-1, not %r" % (what, n), INVALID_ARGUMENT)
    return n


def _cstr(text, what):
    """A str argument the C API takes as a C string: ctypes would cut it at a NUL, and bytes or other types
    would fail with an AttributeError deep in the call."""
    if not isinstance(text, str):
        raise ExpsegError("%s must be a str, not %s" % (what, type(text).__name__), INVALID_ARGUMENT)
    if "\0" in text:
        raise ExpsegError("%s contains a NUL character, which would cut it short: %r" % (what, text), INVALID_ARGUMENT)
    return text.encode()


def _cpath(path, what):
    """A file system path (str, bytes or os.PathLike) as the C API takes it."""
    try:
        raw = os.fsencode(path)
    except TypeError:
        raise ExpsegError("%s must be a path (str, bytes or os.PathLike), not %s" % (what, type(path).__name__),
                          INVALID_ARGUMENT) from None
    if b"\0" in raw:
        raise ExpsegError("%s contains a NUL character, which would cut it short: %r" % (what, path), INVALID_ARGUMENT)
    return raw


def version():
    """expseg's version string."""
    return load().expseg_version().decode()


def configure(conf=""):
    """Sets the configuration (EXPSEG_ALLOC_CONF syntax, applied over it) of allocators not yet created."""
    _check(load().expseg_configure(_cstr("" if conf is None else conf, "the configuration")), "expseg_configure")


def config(device=0):
    """The configuration of the device's allocator (or the one it would get), as key:value,... text."""
    return _text(load().expseg_config(_device(device)), "expseg_config")


def stats(device=0):
    """memory_stats()-style dict: "allocated_bytes.all.peak", "reserved_bytes.all.current", ..., "cupy": {...}."""
    return json.loads(_text(load().expseg_stats_json(_device(device)), "expseg_stats_json"))


def snapshot(device=0):
    """The allocator's segments and blocks (addresses as hex strings) and stats, as a dict."""
    return json.loads(_text(load().expseg_snapshot_json(_device(device)), "expseg_snapshot_json"))


def oom_report(device=0):
    """The text of the device's last out-of-memory report ("" when none)."""
    return _text(load().expseg_last_oom_report(_device(device)), "expseg_last_oom_report")


def oom_report_json(device=0):
    """The device's last out-of-memory report as a dict (None when none)."""
    return json.loads(_text(load().expseg_last_oom_report_json(_device(device)), "expseg_last_oom_report_json"))


def on_oom(fn):
    """Calls fn(report) at every out-of-memory of any device, report being oom_report_json()'s dict
    (report["message"] the text, report["verdict"] capacity/limit/fragmentation (unknown: host memory ran out building the report), report["dump_path"] the
    oom_dump file or ""). It runs on the thread whose allocation failed, before the OOM reaches the
    program (PyTorch's RuntimeError, CuPy's OutOfMemoryError), and may call expseg (snapshot(), stats(),
    release_cached()). An exception in fn is printed and dropped: it cannot cross the C library.
    on_oom(None) removes it."""
    global _oom_callback
    if fn is not None and not callable(fn):
        raise ExpsegError("on_oom takes a callable (or None), not %s" % type(fn).__name__, INVALID_ARGUMENT)
    lib = load()
    if fn is None:
        _check(lib.expseg_set_oom_callback(_OOM_CALLBACK(), None), "expseg_set_oom_callback")
        _oom_callback = None
        return

    def trampoline(device, report_json, _user_data):
        try:
            report = json.loads(report_json.decode("utf-8", "replace"))
            report.setdefault("device", device)
            fn(report)
        except BaseException:  # noqa: B036  ctypes would print and drop it anyway; say whose it was
            import traceback
            sys.stderr.write("expseg.on_oom: the callback raised:\n" + traceback.format_exc())

    cb = _OOM_CALLBACK(trampoline)
    _oom_callbacks_installed.append(cb)
    _check(lib.expseg_set_oom_callback(cb, None), "expseg_set_oom_callback")
    _oom_callback = cb


def release_cached(device=0):
    """Gives cached, unused device memory back to the device (empty_cache())."""
    _check(load().expseg_release_cached(_device(device)), "expseg_release_cached")


def release_stream(stream, device=0):
    """Before destroying a stream the program created: synchronizes it, gives back what is cached for
    it and forgets it (Allocator::release_stream). `stream`: a torch.cuda.Stream (its .cuda_stream),
    an object with .ptr, or the raw handle as an int. Raises while its blocks are in use. (CuPy's
    streams need none: memory install_cupy caches for a stream never has that stream synchronized.)"""
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        handle = getattr(stream, "ptr", stream)
    if handle is None:
        handle = 0
    if isinstance(handle, bool):
        raise ExpsegError("stream %r is not a stream (a torch.cuda.Stream, an object with .ptr, or a handle as an int)"
                          % (stream,), INVALID_ARGUMENT)
    try:
        handle = operator.index(handle)  # not int(): 1.5 or "3" would name another stream
    except TypeError:
        raise ExpsegError("stream %r is not a stream (a torch.cuda.Stream, an object with .ptr, or a handle as an int)"
                          % (stream,), INVALID_ARGUMENT) from None
    handle = _pointer(handle, "stream")  # ctypes would wrap an int past 64 bits into another stream
    _check(load().expseg_release_stream(_device(device), ctypes.c_void_p(handle)), "expseg_release_stream")


def set_limit(nbytes, device=0):
    """Caps the device memory the allocator may hold at nbytes (0: no limit)."""
    _check(load().expseg_set_limit(_device(device), _size(nbytes, "nbytes")), "expseg_set_limit")


def get_limit(device=0):
    """(limit, device_total): the bytes the device's allocator may hold (0: no limit) and the device's memory."""
    limit, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _check(load().expseg_get_limit(_device(device), ctypes.byref(limit), ctypes.byref(total)), "expseg_get_limit")
    return limit.value, total.value


def reset_peak_stats(device=0):
    """Resets the peaks of stats() to the current values."""
    _check(load().expseg_reset_peak_stats(_device(device)), "expseg_reset_peak_stats")


def reset_accumulated_stats(device=0):
    """Restarts the accumulated counters of stats() (each stat's allocated/freed, num_ooms, num_alloc_retries...)."""
    _check(load().expseg_reset_accumulated_stats(_device(device)), "expseg_reset_accumulated_stats")


def record_start(device=0, ring=0):
    """Starts the event recorder afresh (ring > 0 keeps only the last `ring` events)."""
    _check(load().expseg_record_start(_device(device), _size(ring, "ring")), "expseg_record_start")


def record_stop(device=0):
    """Stops the event recorder (what was recorded can still be written)."""
    _check(load().expseg_record_stop(_device(device)), "expseg_record_stop")


def record_write(path, device=0):
    """Writes the recorded events as an RMM CSV trace (gzip when path ends in .gz)."""
    _check(load().expseg_record_write(_device(device), _cpath(path, "path")), "expseg_record_write")


def record_partial(device=0):
    """Whether the recorded events do not start from an empty allocator (recording began while memory was
    allocated or cached, or a full ring dropped the oldest events): their replay starts from another state, and
    needs `expseg replay --lenient` where it frees blocks it never saw allocated."""
    partial = ctypes.c_int(0)
    _check(load().expseg_record_partial(_device(device), ctypes.byref(partial)), "expseg_record_partial")
    return partial.value == 1


def enable_peer_access(peer, device=0):
    """Lets device `peer` read and write everything `device`'s allocator maps, now and later (a peer enabled
    before, or peer == device, does nothing)."""
    _check(load().expseg_enable_peer_access(_device(device), _device(peer)), "expseg_enable_peer_access")


def _pointer(ptr, what):
    """A device address as an int (tensor.data_ptr()): ctypes would wrap a negative or too large int around."""
    if isinstance(ptr, bool) or not isinstance(ptr, int) or not 0 <= ptr < 1 << 64:
        raise ExpsegError("%s must be a device address (an int from 0 to 2**64-1), not %r" % (what, ptr),
                          INVALID_ARGUMENT)
    return ptr


def _fd(fd):
    """A file descriptor as an int: ctypes would wrap fd + 2**32 around into fd, and take True as descriptor 1."""
    try:
        value = None if isinstance(fd, bool) else operator.index(fd)
    except TypeError:
        value = None
    if value is None or not 0 <= value < 1 << 31:
        raise ExpsegError("a file descriptor must be an int from 0 to 2**31-1 (as ipc_export gave it), not %r" % (fd,),
                          INVALID_ARGUMENT)
    return value


def _fd_list(fds):
    """A sequence of descriptors as a list of checked ints (None: none)."""
    if fds is None:
        return []
    try:
        items = list(fds)
    except TypeError:
        raise ExpsegError("fds must be a list of file descriptors (as ipc_export gave it), not %r" % (fds,),
                          INVALID_ARGUMENT) from None
    return [_fd(fd) for fd in items]


def ipc_export(ptr, device=0):
    """The live allocation that starts at `ptr` (e.g. tensor.untyped_storage().data_ptr(): a view's data_ptr() may
    point inside it) as (handle: bytes, fds: list of int),
    for ipc_import in another process. The bytes travel any way. The descriptors (ipc_handle:posix_fd; none for
    split_merge or fabric) are the caller's: send them (ipc_send), or keep them open until the importer has taken
    them (ipc_import without fds), then os.close them. Keep the allocation alive while it is imported."""
    lib = load()
    handle, size = ctypes.c_void_p(), ctypes.c_size_t(0)
    fds, nfds = ctypes.POINTER(ctypes.c_int)(), ctypes.c_size_t(0)
    _check(lib.expseg_ipc_export(_pointer(ptr, "ptr"), _device(device), ctypes.byref(handle), ctypes.byref(size),
                                 ctypes.byref(fds), ctypes.byref(nfds)), "expseg_ipc_export")
    return ctypes.string_at(handle, size.value), [fds[i] for i in range(nfds.value)]


def ipc_import(handle, fds=(), device=0):
    """Maps what ipc_export gave in another process on `device`; returns (ptr, size). `fds` (received with the
    handle, in order) stay the caller's; without them (None or ()) a posix_fd handle's descriptors are taken from
    the exporting process (pidfd_getfd, Linux >= 5.6; both processes in one PID namespace, else an ExpsegError names
    the fallback). Close with ipc_close(ptr, device)."""
    if not isinstance(handle, (bytes, bytearray)):
        raise ExpsegError("handle must be the bytes ipc_export returned, not %r" % type(handle).__name__,
                          INVALID_ARGUMENT)
    fds = _fd_list(fds)
    c_fds = (ctypes.c_int * len(fds))(*fds) if fds else None
    ptr, size = ctypes.c_void_p(), ctypes.c_size_t(0)
    _check(load().expseg_ipc_import(bytes(handle), len(handle), c_fds, len(fds), _device(device), ctypes.byref(ptr),
                                    ctypes.byref(size)), "expseg_ipc_import")
    return ptr.value, size.value


def ipc_close(ptr, device=0):
    """Unmaps memory ipc_import mapped on `device`, once the work queued on `device` is done (as CUDA's IPC close)."""
    _check(load().expseg_ipc_close(_pointer(ptr, "ptr"), _device(device)), "expseg_ipc_close")


# ipc_send / ipc_recv speak expseg::send_fds / recv_fds's wire format (lib/ipc.cpp), so C++'s send_ipc_handle /
# recv_ipc_handle are the other end just as well: a header <magic "EXFD", descriptor count, byte count> (u32, u32,
# u64, little-endian) carrying the first batch of descriptors as SCM_RIGHTS; one byte per further batch (the kernel
# takes at most 253 descriptors a message, SCM_MAX_FD); then the bytes. The batch size is part of the format.
_FD_HEADER = struct.Struct("<IIQ")
_FD_MAGIC = 0x44465845
_FD_BATCH = 250
_FD_MAX = 1 << 20         # descriptors a message may announce
_FD_MAX_BYTES = 1 << 30   # bytes a message may announce
_HANDLE_MAGIC = b"EXPSGIPC"  # the start of every handle ipc_export gives (IpcMemHandle::serialize)


def _unix_stream(sock, who):
    """Raises unless `sock` is an open Unix stream socket.socket (SCM_RIGHTS and the framing need one)."""
    if not isinstance(sock, socket.socket):
        raise ExpsegError("expseg.%s: sock must be a socket.socket (a connected AF_UNIX stream socket), not %r"
                          % (who, type(sock).__name__), INVALID_ARGUMENT)
    if sock.fileno() < 0:
        raise ExpsegError("expseg.%s: the socket is closed" % who, INVALID_ARGUMENT)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        raise ExpsegError("expseg.%s: descriptors travel only over an AF_UNIX SOCK_STREAM socket (e.g. "
                          "socket.socketpair()), not %s %s" % (who, sock.family, sock.type), INVALID_ARGUMENT)


def _close_fds(fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _send_all(sock, data, fds):
    """One write of `data` carrying `fds`, then the rest of `data` if the socket took only part of it."""
    flags = getattr(socket, "MSG_NOSIGNAL", 0)  # EPIPE as an error, never SIGPIPE
    view = memoryview(data)
    if fds:
        view = view[sock.sendmsg([view], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))], flags):]
    while view:
        view = view[sock.send(view, flags):]


def _recv_exactly(sock, n, fds, what):
    """`n` bytes from `sock`; every descriptor that comes with them is appended to `fds` (the caller closes them on
    error). Reads at most 1 MiB at a time: a garbage header's byte count must not allocate that much up front."""
    buf = bytearray()
    ancbuf = socket.CMSG_SPACE(256 * array.array("i").itemsize)  # one SCM_RIGHTS batch at most per read
    flags = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    while len(buf) < n:
        try:
            data, ancdata, msg_flags, _ = sock.recvmsg(min(n - len(buf), 1 << 20), ancbuf, flags)
        except OSError as e:
            raise ExpsegError("expseg.ipc_recv: receiving %s failed: %s" % (what, e), IPC) from e
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(cdata[:len(cdata) - len(cdata) % got.itemsize])
                fds.extend(got)
        if msg_flags & socket.MSG_CTRUNC:
            raise ExpsegError("expseg.ipc_recv: descriptors were dropped (MSG_CTRUNC): this process is at its open-file "
                              "limit (RLIMIT_NOFILE), or the sender attached more than one batch to a byte", IPC)
        if not data:
            raise ExpsegError("expseg.ipc_recv: the peer closed the socket after %d of %d bytes of %s"
                              % (len(buf), n, what), IPC)
        buf += data
    return bytes(buf)


def ipc_send(sock, handle, fds=()):
    """Sends what ipc_export gave (the handle's bytes and its descriptors, any number of them) as one message over a
    connected Unix stream socket; ipc_recv, or C++'s expseg::recv_ipc_handle, receives it. The descriptors go as
    SCM_RIGHTS (batches of 250) and stay the caller's: the receiver gets duplicates, so close them once sent. The
    socket must block (a timeout is fine); one that fails midway cannot carry another message."""
    _unix_stream(sock, "ipc_send")
    if not isinstance(handle, (bytes, bytearray)):
        raise ExpsegError("expseg.ipc_send: handle must be the bytes ipc_export returned, not %r"
                          % type(handle).__name__, INVALID_ARGUMENT)
    if not handle.startswith(_HANDLE_MAGIC):
        raise ExpsegError("expseg.ipc_send: handle is not an expseg IPC handle (the bytes ipc_export returned start "
                          "with %r, these with %r)" % (_HANDLE_MAGIC, bytes(handle[:len(_HANDLE_MAGIC)])),
                          INVALID_ARGUMENT)
    fds = _fd_list(fds)
    if len(handle) > _FD_MAX_BYTES or len(fds) > _FD_MAX:
        raise ExpsegError("expseg.ipc_send: a handle of %d bytes with %d descriptors is too large to send"
                          % (len(handle), len(fds)), INVALID_ARGUMENT)
    try:
        _send_all(sock, _FD_HEADER.pack(_FD_MAGIC, len(fds), len(handle)), fds[:_FD_BATCH])
        for i in range(_FD_BATCH, len(fds), _FD_BATCH):
            _send_all(sock, b"\0", fds[i:i + _FD_BATCH])
        _send_all(sock, handle, [])
    except OSError as e:
        raise ExpsegError("expseg.ipc_send: sending the handle and %d descriptors failed: %s" % (len(fds), e),
                          IPC) from e


def ipc_recv(sock):
    """Receives one message of ipc_send (or of C++'s expseg::send_ipc_handle) from a Unix stream socket: returns
    (handle, fds) for ipc_import. The descriptors are the caller's (close-on-exec): close them after ipc_import.
    A peer that closes early or sends something else raises ExpsegError, and the descriptors that had come are
    closed."""
    _unix_stream(sock, "ipc_recv")
    fds = []
    try:
        magic, nfds, nbytes = _FD_HEADER.unpack(_recv_exactly(sock, _FD_HEADER.size, fds, "the message header"))
        if magic != _FD_MAGIC:
            raise ExpsegError("expseg.ipc_recv: the message was not sent by ipc_send or expseg::send_ipc_handle "
                              "(magic 0x%x)" % magic, IPC)
        if nfds > _FD_MAX or nbytes > _FD_MAX_BYTES:
            raise ExpsegError("expseg.ipc_recv: implausible message header (%d descriptors, %d bytes)"
                              % (nfds, nbytes), IPC)
        for _ in range(1, (nfds + _FD_BATCH - 1) // _FD_BATCH):
            _recv_exactly(sock, 1, fds, "a batch of descriptors")
        handle = _recv_exactly(sock, nbytes, fds, "the handle")
        if len(fds) != nfds:
            raise ExpsegError("expseg.ipc_recv: received %d descriptors, the sender sent %d" % (len(fds), nfds), IPC)
        if not handle.startswith(_HANDLE_MAGIC):
            raise ExpsegError("expseg.ipc_recv: the message does not hold an expseg IPC handle (it starts with %r)"
                              % handle[:len(_HANDLE_MAGIC)], IPC)
    except BaseException:  # noqa: B036  KeyboardInterrupt too: nothing received may leak
        _close_fds(fds)
        raise
    return handle, fds


def initialized_devices():
    """The device indexes that have an expseg allocator."""
    lib = load()
    return [d for d in range(MAX_DEVICES) if lib.expseg_device_initialized(d) == 1]


# --- PyTorch's memory API over expseg ---------------------------------------------------------------------------
# PyTorch's pluggable allocator answers torch.cuda.memory_stats(), reset_peak_memory_stats(), memory_snapshot()
# and _record_memory_history() with "CUDAPluggableAllocator does not yet support ...", and ignores empty_cache(),
# set_per_process_memory_fraction() and Tensor.record_stream(). install_torch() routes them to expseg (see
# _patch_torch), so programs and tools that log torch.cuda.max_memory_allocated() or take snapshots keep working.

def torch_memory_stats(device=0):
    """stats() in the shape of PyTorch's torch._C._cuda_memoryStats: a nested dict that
    torch.cuda.memory_stats() flattens back to "allocated_bytes.all.peak" and the like."""
    nested = {}
    for key, value in stats(device).items():
        if isinstance(value, dict):  # "cupy": CuPy's figures, not a PyTorch stat
            continue
        node = nested
        path = key.split(".")
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return nested


_TORCH_BLOCK_STATE = {"allocated": "active_allocated", "pending_free": "active_pending_free", "free_mapped": "inactive"}


def _torch_segments(device, snap):
    """PyTorch snapshot segments of one device: a split_merge segment is one, an expandable segment gives one per
    mapped range (PyTorch shows its own expandable segments the same way); unmapped address space is left out."""
    out = []
    expandable = snap.get("backend") == "expandable"
    for seg in snap["segments"]:
        ranges = seg.get("mapped_ranges")
        if ranges is None:
            ranges = [{"address": seg["address"], "size": seg["size"]}]
        pieces = [(int(r["address"], 16), r["size"], []) for r in ranges]
        for b in seg["blocks"]:
            state = _TORCH_BLOCK_STATE.get(b["state"])
            if state is None:  # free_unmapped: no memory behind it
                continue
            addr = int(b["address"], 16)
            for lo, size, blocks in pieces:
                if lo <= addr < lo + size:
                    blocks.append({"address": addr, "size": b["size"], "requested_size": b["requested"],
                                   "state": state, "frames": []})
                    break
        for lo, size, blocks in pieces:
            allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
            out.append({
                "device": device, "address": lo, "total_size": size, "stream": int(seg["stream"], 16),
                "segment_type": seg.get("pool", "large"),
                "segment_pool_id": _torch_pool_ids.get(seg.get("graph_pool", 0), (0, 0)), "is_expandable": expandable,
                "allocated_size": allocated,
                "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
                # As PyTorch's snapshot: every active block, frees still waiting for other streams' work included.
                "requested_size": sum(b["requested_size"] for b in blocks if b["state"] != "inactive"),
                "frames": [], "blocks": blocks,
            })
    return out


def _snapshot_and_trace(device):
    """The device's snapshot and its recorded events (record_start / record:true) of the same moment,
    the events as PyTorch trace entries."""
    import csv
    import tempfile
    fd, path = tempfile.mkstemp(prefix="expseg-trace-", suffix=".csv")
    os.close(fd)
    try:
        # One call, one lock: events another thread adds between a snapshot and a separate record_write
        # would not be in the snapshot, and memory_viz, which walks the events back from it, breaks.
        snap = json.loads(_text(load().expseg_snapshot_json_with_trace(device, _cpath(path, "path")),
                                "expseg_snapshot_json_with_trace"))
        seg_alloc, seg_free = (("segment_map", "segment_unmap") if snap.get("backend") == "expandable"
                               else ("segment_alloc", "segment_free"))
        actions = {"allocate": "alloc", "free": "free_requested", "free completed": "free_completed",
                   "map": seg_alloc, "unmap": seg_free, "allocate failure": "oom"}
        with open(path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r["Action"] in actions]
    finally:
        os.unlink(path)
    # A free that waited for other streams' work (record_stream) has its own "free completed" line
    # later; any other free completes as it is requested, except one still waiting at the snapshot (its
    # block is active_pending_free there: no completion yet, as in PyTorch's trace). Walked backwards: a
    # completion belongs to the latest free of its address before it (the address is not allocated again
    # in between).
    completes_later = [False] * len(rows)
    waiting = {int(b["address"], 16) for seg in snap.get("segments", []) for b in seg.get("blocks", [])
               if b.get("state") == "pending_free"}
    for i in range(len(rows) - 1, -1, -1):
        action, addr = rows[i]["Action"], int(rows[i]["Pointer"] or "0", 16)
        if action == "free completed":
            waiting.add(addr)
        elif action == "free":
            completes_later[i] = addr in waiting
            waiting.discard(addr)
        elif action == "allocate":
            waiting.discard(addr)
    entries = []
    for i, row in enumerate(rows):
        action = actions[row["Action"]]
        h, m, sec = row["Time"].split(":")
        entry = {"action": action, "addr": int(row["Pointer"], 16), "size": int(row["Size"]),
                 "stream": int(row["Stream"], 16), "time_us": int((int(h) * 3600 + int(m) * 60 + float(sec)) * 1e6),
                 "frames": []}
        if action == "oom":
            del entry["addr"]
            entry["device_free"] = 0
        entries.append(entry)
        if action == "free_requested" and not completes_later[i]:  # PyTorch logs the request, then its completion
            entries.append(dict(entry, action="free_completed"))
    return snap, entries


def graph_pool_blocks(pool, device=0):
    """The allocated blocks of expseg graph pool `pool` (a number) on `device`: [(address, size)], by address."""
    lib = load()
    device = _device(device)
    pool = _size(pool, "graph_pool_blocks: pool")
    count = ctypes.c_size_t(0)
    capacity = 0
    while True:
        addrs = (ctypes.c_ulonglong * max(capacity, 1))()
        sizes = (ctypes.c_size_t * max(capacity, 1))()
        _check(lib.expseg_graph_pool_blocks(device, pool, addrs, sizes, capacity, ctypes.byref(count)),
               "expseg_graph_pool_blocks")
        if count.value <= capacity:
            return [(addrs[i], sizes[i]) for i in range(count.value)]
        capacity = count.value + 16  # blocks made meanwhile (another thread): ask again with room to spare


def torch_snapshot(devices=None):
    """The allocators' state as PyTorch's torch.cuda.memory._snapshot() gives it ({"segments": [...],
    "device_traces": [[...] per device]}), so torch.cuda.memory._dump_snapshot() writes a file that
    https://pytorch.org/memory_viz opens. Traces hold what the event recorder recorded (no stack frames)."""
    if devices is None:
        devices = initialized_devices()
    elif isinstance(devices, (int, str)) or hasattr(devices, "index") and hasattr(devices, "type"):
        devices = [devices]  # one device, as an index, "cuda:N" or a torch.device
    devices = [_device(d) for d in devices]
    segments = []
    traces = [[] for _ in range(max(devices, default=-1) + 1)]
    for d in devices:
        snap, trace = _snapshot_and_trace(d)
        segments.extend(_torch_segments(d, snap))
        # expseg's ring counts a free once, PyTorch's twice (free_requested, free_completed): keep PyTorch's
        # bound on the entries returned, as its ring would have.
        traces[d] = trace[-_history_max_entries:] if _history_max_entries else trace
    return {"segments": segments, "device_traces": traces}


def _patch_torch(torch):
    """Routes PyTorch's memory API, which its pluggable allocator does not serve, to expseg."""
    C = torch._C

    def memory_stats(device):
        return torch_memory_stats(device)

    def empty_cache():
        trees = getattr(torch.cuda.CUDAGraph, "_expseg_trees", None)
        if trees is not None:
            trees.sweep()
        lib = load()
        for d in initialized_devices():
            rc = lib.expseg_release_cached(d)
            if rc == INVALID_ARGUMENT:
                # A capture allocates into a graph pool on d, where giving memory back would synchronize and
                # invalidate it: as PyTorch's empty_cache() while a capture is underway, nothing is given back.
                lib.expseg_clear_error()
                continue
            _check(rc, "expseg_release_cached")

    fractions = {}  # device -> (fraction set, the limit it became): read back as set while the limit stands

    def set_memory_fraction(fraction, device):
        _, total = get_limit(device)
        # PyTorch's limit is fraction * total; 1.0 is no limit at all (so an OOM then says capacity, not limit);
        # 0.0 is a limit of one byte (expseg's 0 would mean none).
        limit = 0 if fraction >= 1.0 else max(1, int(fraction * total))
        set_limit(limit, device)
        fractions[device] = (fraction, limit)

    def get_memory_fraction(device):
        limit, total = get_limit(device)
        if device in fractions and fractions[device][1] == limit:
            return fractions[device][0]
        if limit == 1:
            return 0.0  # expseg's smallest limit stands for PyTorch's 0 bytes (per_process_memory_fraction:0)
        return 1.0 if limit == 0 or total == 0 else limit / total

    def memory_snapshot(*_args, **_kwargs):
        return torch_snapshot()

    def record_history(enabled, max_entries):
        global _history_max_entries
        ring = 0 if max_entries is None or max_entries >= sys.maxsize else int(max_entries)
        _history_max_entries = ring if enabled else 0
        # Devices first used later record too (PyTorch records on every device).
        _check(load().expseg_set_record_default(1 if enabled else 0, ring), "expseg_set_record_default")
        for d in initialized_devices():
            if enabled:
                record_start(d, ring)
            else:
                record_stop(d)

    def record_memory_history(enabled, context=None, stacks=None, max_entries=None, *_args, **_kwargs):
        # As PyTorch (memory_snapshot.cpp): max_entries applies to "all" only; "state" keeps one entry (it
        # tracks live blocks, not a history), and never fewer than one.
        if enabled is None:
            record_history(False, None)
        else:
            record_history(True, max(1, max_entries) if enabled == "all" and max_entries is not None else 1)

    def record_memory_history_legacy(enabled, record_context=True, trace_alloc_max_entries=1, *_args, **_kwargs):
        record_history(bool(enabled), max(1, trace_alloc_max_entries))  # PyTorch's default keeps one entry

    replacements = {
        "_cuda_memoryStats": memory_stats,
        "_cuda_resetPeakMemoryStats": reset_peak_stats,
        "_cuda_resetAccumulatedMemoryStats": reset_accumulated_stats,
        "_cuda_emptyCache": empty_cache,
        "_cuda_setMemoryFraction": set_memory_fraction,
        "_cuda_getMemoryFraction": get_memory_fraction,
        "_cuda_memorySnapshot": memory_snapshot,
        "_cuda_record_memory_history": record_memory_history,
        "_cuda_record_memory_history_legacy": record_memory_history_legacy,
    }
    for name, fn in replacements.items():
        if hasattr(C, name):
            setattr(C, name, fn)

    # torch.cuda.memory._set_allocator_settings (PyTorch <= 2.8: _cuda_cudaCachingAllocator_set_allocator_settings,
    # later _accelerator_setAllocatorSettings): PyTorch's call goes on (its pinned host memory keys apply), but
    # the device keys would change nothing of expseg's, whose configuration is fixed once an allocator exists: a
    # program that turns expandable_segments off for a while (to share memory by IPC, say) is told, not ignored.
    def settings_warning(torch_set_settings):
        def set_allocator_settings(env, *args, **kwargs):
            result = torch_set_settings(env, *args, **kwargs)
            keys = [item.split(":", 1)[0].strip() for item in str(env).split(",") if item.strip()]
            device_keys = [k for k in keys if not k.startswith("pinned_")]
            if device_keys:
                import warnings
                warnings.warn("expseg serves this process's CUDA memory: torch.cuda.memory._set_allocator_settings(%r) "
                              "does not change its allocators (%s; set expseg's configuration with EXPSEG_ALLOC_CONF "
                              "or install_torch(conf) before the first allocation)" % (str(env), ", ".join(device_keys)),
                              RuntimeWarning, stacklevel=3)
            return result
        return set_allocator_settings

    for name in ("_cuda_cudaCachingAllocator_set_allocator_settings", "_accelerator_setAllocatorSettings"):
        if hasattr(C, name) and not getattr(getattr(C, name), "_expseg_patched", False):
            patched = settings_warning(getattr(C, name))
            patched._expseg_patched = True
            setattr(C, name, patched)

    # Tensor.record_stream: PyTorch's call (its checks; a no-op under a pluggable allocator), then expseg's, so
    # that memory freed on its stream is not handed out again before the other stream's work is done.
    torch_record_stream = torch.Tensor.record_stream
    lib = load()

    def record_stream(self, stream):
        torch_record_stream(self, stream)
        if not self.is_cuda:
            return
        ptr = self.untyped_storage().data_ptr()
        handle = getattr(stream, "cuda_stream", None)
        if handle is None:  # a torch.Stream: the same stream as a torch.cuda.Stream
            handle = torch.cuda.Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                                       device_type=stream.device_type).cuda_stream
        if ptr and lib.expseg_record_stream(ptr, self.device.index, handle) != SUCCESS:
            if lib.expseg_last_error_code() == INVALID_POINTER:  # not expseg's memory (from_blob, DLPack)
                lib.expseg_clear_error()
                return
            raise _error("expseg_record_stream")

    record_stream.__doc__ = torch_record_stream.__doc__
    torch.Tensor.record_stream = record_stream

    # CUDA graphs: PyTorch tells a pluggable allocator nothing of a capture (its private-pool hooks cannot be set
    # from Python), so the glue does: capture_begin opens an expseg graph pool for the capture (the graph's own,
    # or the one pool= names, as PyTorch's private pools), capture_end closes it, and reset() or the graph's
    # destruction releases it. Memory the graph uses then goes to no other tensor while it may replay, and
    # expseg makes no call during the capture that would invalidate it.
    CUDAGraph = getattr(torch.cuda, "CUDAGraph", None)
    if CUDAGraph is None or getattr(CUDAGraph, "_expseg_patched", False):
        return
    torch_capture_begin, torch_capture_end = CUDAGraph.capture_begin, CUDAGraph.capture_end
    torch_reset = getattr(CUDAGraph, "reset", None)
    pool_numbers = {"next": 0}  # PyTorch's pool id (a, b) -> expseg's pool number; "next": the last one made
    next_number = threading.Lock()  # two threads' captures never share a number (a pool)

    def pool_number(pool):
        a, b = (int(v) for v in pool)
        number = pool_numbers.get((a, b)) or ((a & 0xFFFFFFFF) << 32 | (b & 0xFFFFFFFF) | (1 << 63))
        _torch_pool_ids[number] = (a, b)
        return number

    trees = _GraphTrees(torch, lib, pool_number)

    def capture_begin(self, pool=None, capture_error_mode="global"):
        # Before the capture begins, expseg asks whether its stream blocks (it cannot be asked later): if not,
        # expseg may take back the default stream's idle memory during the capture. Best effort.
        if lib.expseg_prepare_capture(torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream) != SUCCESS:
            lib.expseg_clear_error()
        if pool is None:
            torch_capture_begin(self, capture_error_mode=capture_error_mode)
        else:
            torch_capture_begin(self, pool, capture_error_mode=capture_error_mode)
        # PyTorch names a graph's own pool only once the capture has ended (CUDAGraph.pool()): a graph without
        # pool= gets a number of the glue's, which capture_end files under PyTorch's id for later pool= uses.
        if pool is None:
            with next_number:
                pool_numbers["next"] += 1
                number = pool_numbers["next"]
        else:
            number = pool_number(pool)
        device = torch.cuda.current_device()
        trees.sweep(device)
        if lib.expseg_begin_graph_pool(device, number, torch.cuda.current_stream().cuda_stream) != SUCCESS:
            error = _error("expseg_begin_graph_pool")
            try:
                torch_capture_end(self)  # leave no stream capturing behind
            except Exception:
                pass
            raise error
        self._expseg_pool = (device, number)
        releases = self.__dict__.setdefault("_expseg_releases", [])
        releases.append(weakref.finalize(self, lib.expseg_release_graph_pool, device, number))

    def capture_end(self):
        try:
            torch_capture_end(self)
        finally:
            device, number = self.__dict__.pop("_expseg_pool", (None, None))
            if device is not None:
                _check(lib.expseg_end_graph_pool(device, number), "expseg_end_graph_pool")
        a, b = self.pool()
        pool_numbers[(int(a), int(b))] = number
        _torch_pool_ids[number] = (int(a), int(b))

    def reset(self):
        if torch_reset is not None:
            torch_reset(self)
        for release in self.__dict__.pop("_expseg_releases", []):
            release()  # once: a finalizer that ran does nothing more

    capture_begin.__doc__ = torch_capture_begin.__doc__
    capture_end.__doc__ = torch_capture_end.__doc__
    CUDAGraph.capture_begin, CUDAGraph.capture_end, CUDAGraph.reset = capture_begin, capture_end, reset
    CUDAGraph._expseg_patched = True
    CUDAGraph._expseg_trees = trees
    trees.install()


class _GraphTrees:
    """torch.compile(mode="reduce-overhead"): PyTorch's CUDA graph trees (torch/_inductor/cudagraph_trees.py)
    drive its caching allocator's private pools through torch._C entry points that its pluggable allocator
    does not serve (it raises, or does nothing). Each is routed to expseg's graph pools:

    - _cuda_beginAllocateCurrentThreadToPool / _cuda_endAllocateToPool / _cuda_releasePool (the warm-ups, the
      copies of a recording's inputs): the current stream's requests go to the pool (expseg_begin_pool_allocations),
      as the capture's later do;
    - _cuda_checkPoolLiveAllocations (the trees' checks of their own bookkeeping): whether the pool's allocated
      blocks are exactly the live storages given;
    - _cuda_getCheckpointState: the pool's allocated blocks once a graph is recorded;
    - _cuda_setCheckpointPoolState (recording or warming up after replays, in the middle of a path): the pool's
      blocks put back to a checkpoint's (expseg_restore_graph_pool_block). PyTorch then gives the live outputs'
      storages its deleter; a pluggable allocator's cannot be set from Python, so the glue keeps a weak reference
      to each such storage and frees its block once the storage is gone: at the trees' next call into the pool,
      a capture's begin or empty_cache(), before anything could allocate in the pool again;
    - _cuda_cudaCachingAllocator_raw_delete: frees such restored blocks (others go to PyTorch's as before);
      _has_Standard_Deleter: true of the storages such blocks were given to (PyTorch's check that they free them);
      _free_And_Remove_DeleterFn: for such a storage, frees its block (others: PyTorch's, as before).
    """

    def __init__(self, torch, lib, pool_number):
        self.torch, self.lib, self.pool_number = torch, lib, pool_number
        self.routes = {}    # (device, pool number) -> streams begun (begin_pool_allocations), last first
        self.restored = {}  # (device, address) -> (StorageWeakRef, StorageImpl address) it was given to, or None
        self.lock = threading.RLock()  # each thread has trees of its own; these dicts are shared
        # How often PyTorch called each entry point (tests check that a path was taken).
        self.calls = {"begin": 0, "end": 0, "release": 0, "check": 0, "get_checkpoint": 0, "set_checkpoint": 0,
                      "restored_blocks": 0, "raw_delete": 0}

    def install(self):
        C = self.torch._C
        self.torch_raw_delete = getattr(C, "_cuda_cudaCachingAllocator_raw_delete", None)
        self.torch_has_standard_deleter = getattr(C, "_has_Standard_Deleter", None)
        self.torch_free_and_remove_deleter = getattr(C, "_free_And_Remove_DeleterFn", None)
        replacements = {
            "_cuda_beginAllocateCurrentThreadToPool": self.begin_allocate_to_pool,
            "_cuda_beginAllocateCurrentStreamToPool": self.begin_allocate_to_pool,  # PyTorch before 2.6
            "_cuda_endAllocateToPool": self.end_allocate_to_pool,
            "_cuda_endAllocateCurrentStreamToPool": self.end_allocate_to_pool,    # PyTorch before 2.6
            "_cuda_releasePool": self.release_pool,
            "_cuda_checkPoolLiveAllocations": self.check_pool_live_allocations,
            "_cuda_getCheckpointState": self.get_checkpoint_state,
            "_cuda_setCheckpointPoolState": self.set_checkpoint_pool_state,
            "_cuda_cudaCachingAllocator_raw_delete": self.raw_delete,
            "_has_Standard_Deleter": self.has_standard_deleter,
            "_free_And_Remove_DeleterFn": self.free_and_remove_deleter,
        }
        for name, fn in replacements.items():
            if hasattr(C, name):
                setattr(C, name, fn)

    def _free(self, device, address):
        self.lib.expseg_clear_error()  # expseg_free returns nothing: its failure shows in the thread's code
        self.lib.expseg_free(ctypes.c_void_p(address), 0, device, None)
        if self.lib.expseg_last_error_code() != SUCCESS:
            raise _error("expseg_free")

    def sweep(self, device=None):
        """Frees the restored blocks whose storages are gone. One that no storage took stays allocated until
        raw_delete, as in PyTorch (the trees raw_delete those of outputs dead since the replay right away)."""
        with self.lock:
            for key, ref in list(self.restored.items()):
                if (device is None or key[0] == device) and ref is not None and ref[0].expired():
                    del self.restored[key]
                    self._free(*key)

    def begin_allocate_to_pool(self, device, pool):
        self.calls["begin"] += 1
        device = int(device)
        self.sweep(device)
        number = self.pool_number(pool)
        stream = self.torch.cuda.current_stream(device).cuda_stream
        _check(self.lib.expseg_begin_pool_allocations(device, number, stream), "expseg_begin_pool_allocations")
        self.routes.setdefault((device, number), []).append(stream)

    def end_allocate_to_pool(self, device, pool=None):
        self.calls["end"] += 1
        device = int(device)
        if pool is None:  # PyTorch before 2.6 names no pool: the route of the current stream
            stream = self.torch.cuda.current_stream(device).cuda_stream
            for (d, number), streams in self.routes.items():
                if d == device and stream in streams:
                    break
            else:
                raise ExpsegError("expseg: _cuda_endAllocateCurrentStreamToPool: the current stream allocates into "
                                  "no graph pool", INVALID_ARGUMENT)
        else:
            number = self.pool_number(pool)
        streams = self.routes.get((device, number))
        if not streams:
            raise ExpsegError("expseg: _cuda_endAllocateToPool: no stream allocates into pool %r" % (pool,),
                              INVALID_ARGUMENT)
        stream = streams.pop()
        _check(self.lib.expseg_end_pool_allocations(device, number, stream), "expseg_end_pool_allocations")

    def release_pool(self, device, pool):
        self.calls["release"] += 1
        _check(self.lib.expseg_release_graph_pool(int(device), self.pool_number(pool)), "expseg_release_graph_pool")

    def check_pool_live_allocations(self, device, pool, live_ptrs):
        self.calls["check"] += 1
        device = int(device)
        self.sweep(device)
        allocated = [a for a, _ in graph_pool_blocks(self.pool_number(pool), device)]
        return len(allocated) == len(live_ptrs) and set(allocated) == set(int(p) for p in live_ptrs)

    def get_checkpoint_state(self, device, pool):
        self.calls["get_checkpoint"] += 1
        device = int(device)
        self.sweep(device)
        return _PoolCheckpoint(device, pool, self.pool_number(pool), graph_pool_blocks(self.pool_number(pool), device))

    def set_checkpoint_pool_state(self, device, state, stale_storages, storages_to_add_deleters_to=()):
        self.calls["set_checkpoint"] += 1
        device = int(device)
        if not isinstance(state, _PoolCheckpoint):
            raise ExpsegError("expseg: _cuda_setCheckpointPoolState needs a state from _cuda_getCheckpointState "
                              "under expseg, got %r" % type(state).__name__, INVALID_ARGUMENT)
        if stale_storages:
            # PyTorch passes none today ("we deallocate instead of allowing stale recordings"); taking their
            # deleters away needs PyTorch's C++.
            raise ExpsegError("expseg: _cuda_setCheckpointPoolState with stale storages is not supported under "
                              "expseg's pluggable allocator", INVALID_ARGUMENT)
        with self.lock:
            self._set_checkpoint_pool_state(device, state, storages_to_add_deleters_to)

    def _set_checkpoint_pool_state(self, device, state, storages_to_add_deleters_to):
        self.sweep(device)
        wanted = dict(state.blocks)
        # As PyTorch's: the pool's blocks that the checkpoint does not list are freed (no live storage owns
        # them: the trees freed or gave up their outputs); those it lists and the pool lacks are made again
        # where they were. A block allocated in both stays as it is, with its owner.
        for address, size in graph_pool_blocks(state.number, device):
            if wanted.get(address) == size:
                del wanted[address]
            else:
                self.restored.pop((device, address), None)
                self._free(device, address)
        for address, size in sorted(wanted.items()):
            _check(self.lib.expseg_restore_graph_pool_block(device, state.number, ctypes.c_void_p(address), size),
                   "expseg_restore_graph_pool_block")
            self.restored[(device, address)] = None
            self.calls["restored_blocks"] += 1
        # The live outputs' storages (PyTorch gives them its deleter): their blocks are freed once they are gone.
        # As in PyTorch, the checkpoint's blocks belong to the storages given now (an earlier owner is stale).
        for address in dict(state.blocks):
            if (device, address) in self.restored:
                self.restored[(device, address)] = None
        reductions = getattr(getattr(self.torch, "multiprocessing", None), "reductions", None)
        if reductions is None:
            import torch.multiprocessing.reductions as reductions
        StorageWeakRef = reductions.StorageWeakRef
        for cdata in storages_to_add_deleters_to:
            storage = self.torch.UntypedStorage._new_with_weak_ptr(cdata)
            if storage is None:
                continue
            key = (device, storage.data_ptr())
            if key in self.restored and self.restored[key] is None:
                self.restored[key] = (StorageWeakRef(storage), int(cdata))
            del storage

    def _restored_to(self, storage_ptr):
        """The restored block's key given to the live storage at StorageImpl address storage_ptr, or None."""
        with self.lock:
            for key, ref in self.restored.items():
                if ref is not None and ref[1] == int(storage_ptr) and not ref[0].expired():
                    return key
        return None

    def has_standard_deleter(self, storage_ptr):
        # The trees' check (slow_path_cudagraph_asserts) that a live output's storage now frees its memory to the
        # allocator when it dies: true of a storage a restored block was given to (the glue frees the block then).
        if self._restored_to(storage_ptr) is not None:
            return True
        return self.torch_has_standard_deleter(storage_ptr) if self.torch_has_standard_deleter is not None else False

    def free_and_remove_deleter(self, storage_ptr):
        # The trees end a generation: a live output's memory goes back to the pool, its storage keeps the address
        # without owning it. For a storage a restored block was given to, that block.
        with self.lock:
            key = self._restored_to(storage_ptr)
            if key is not None:
                del self.restored[key]
                self._free(*key)
                return
        return self.torch_free_and_remove_deleter(storage_ptr)

    def raw_delete(self, ptr):
        with self.lock:
            for key in [k for k in self.restored if k[1] == int(ptr)]:
                self.calls["raw_delete"] += 1
                del self.restored[key]
                self._free(*key)
                return
        if self.torch_raw_delete is None:
            raise ExpsegError("expseg: raw_delete of %#x, which is not a block expseg restored" % int(ptr), INVALID_POINTER)
        self.torch_raw_delete(ptr)


class _PoolCheckpoint:
    """What _cuda_getCheckpointState returns under expseg: a graph pool's allocated blocks."""

    def __init__(self, device, pool, number, blocks):
        self.device, self.pool, self.number, self.blocks = device, pool, number, tuple(blocks)

    def __repr__(self):
        return "expseg pool checkpoint (device %d, pool %r, %d blocks)" % (self.device, self.pool, len(self.blocks))


def install_torch(conf="", raise_on_oom=True, patch_torch=True):
    """Makes expseg PyTorch's CUDA allocator (CUDAPluggableAllocator). Call before any CUDA tensor exists.

    An OOM raises torch.cuda.OutOfMemoryError carrying expseg's report, as under PyTorch's own allocator, where
    libexpseg_torch.so was built for this PyTorch (meson builds it where python3 imports torch); otherwise
    RuntimeError with the same report (expseg_torch_malloc throws; PyTorch turns the exception into a Python
    error). torch_oom_error() says which. The program can catch it and go on. PyTorch's pluggable
    allocator does not check for NULL: raise_on_oom=False installs expseg_malloc, which returns NULL
    and prints the report on stderr, and the next kernel then fails on the NULL tensor.

    PyTorch's pluggable allocator serves no memory API of its own; with patch_torch (the default) PyTorch's
    memory functions are routed to expseg: torch.cuda.memory_stats() and everything built on it
    (memory_allocated, max_memory_reserved, memory_summary...), reset_peak_memory_stats(),
    reset_accumulated_memory_stats(), empty_cache(), set/get_per_process_memory_fraction() (expseg's limit),
    torch.cuda.memory._record_memory_history() (expseg's event recorder), _snapshot() / _dump_snapshot() and
    memory_snapshot() (expseg's segments and blocks in PyTorch's format), and Tensor.record_stream(). CUDA graph
    captures (torch.cuda.graph, CUDAGraph.capture_begin/end, make_graphed_callables) allocate from expseg graph
    pools, released with the graph.
    torch.backends.cudnn.benchmark=True is not supported by PyTorch's pluggable allocator.
    """
    global _torch_allocator, _torch_conf, _torch_oom_error
    torch = _import("torch", "install_torch", "PyTorch", "pip install torch")
    options = (conf, bool(raise_on_oom), bool(patch_torch))
    if _torch_allocator is not None:
        if options == _torch_conf:
            return _torch_allocator
        raise ExpsegError("expseg.install_torch: already installed with conf=%r, raise_on_oom=%r, patch_torch=%r; "
                          "these cannot change in this process" % _torch_conf, ALREADY_INITIALIZED)
    if torch.cuda.is_initialized():
        raise ExpsegError(
            "expseg.install_torch() must be called before any CUDA tensor exists: CUDA is already initialized in "
            "this process, so PyTorch's allocator can no longer be replaced. Call it right after `import torch`, "
            "before anything touches the GPU.", ALREADY_INITIALIZED)
    load()
    _configure_for("install_torch", conf)
    path, malloc_name, free_name, oom_error = _lib_path, "expseg_malloc", "expseg_free", None
    if raise_on_oom:
        path, malloc_name, free_name, oom_error = _torch_malloc_library(torch)
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, malloc_name, free_name)
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:
        raise ExpsegError("expseg.install_torch: PyTorch refused to switch allocators (%s); it must happen before "
                          "any CUDA tensor exists" % e, ALREADY_INITIALIZED) from e
    if patch_torch:
        _patch_torch(torch)
    _torch_allocator, _torch_conf, _torch_oom_error = alloc, options, oom_error
    return alloc


def torch_oom_error():
    """The exception class an OOM raises under install_torch: torch.cuda.OutOfMemoryError where
    libexpseg_torch.so was built for the running PyTorch, else RuntimeError; None before install_torch or
    with raise_on_oom=False (no exception: PyTorch gets NULL). torch.cuda.OutOfMemoryError is a RuntimeError,
    so `except RuntimeError` catches an OOM either way."""
    return _torch_oom_error


def _torch_library_path():
    """libexpseg_torch.so: $EXPSEG_TORCH_LIBRARY, else beside libexpseg.so (an install) or in its build tree's
    lib/torch/ (where libexpseg.so was named by its path: also beside the file a link names), else where the
    system's loader finds it (as library_path() looks); None where there is none."""
    env = os.environ.get("EXPSEG_TORCH_LIBRARY")
    if env:
        if not os.path.isfile(env):
            raise ExpsegError("EXPSEG_TORCH_LIBRARY=%r: no such file (point it at libexpseg_torch.so)" % env,
                              INVALID_ARGUMENT)
        return os.path.abspath(env)
    if os.path.isabs(_lib_path):
        dirs = [os.path.dirname(_lib_path), os.path.dirname(os.path.realpath(_lib_path))]
        for here in dict.fromkeys(dirs):
            for candidate in (os.path.join(here, "libexpseg_torch.so"), os.path.join(here, "torch", "libexpseg_torch.so")):
                if os.path.isfile(candidate):
                    return candidate
        return None
    return _found_by_loader("expseg_torch")


def _torch_malloc_library(torch):
    """(path, malloc name, free name, OOM exception class) for install_torch's CUDAPluggableAllocator.

    PyTorch takes an OOM for one only as the C++ type c10::OutOfMemoryError (torch.cuda.OutOfMemoryError in
    Python; cuDNN's convolutions catch it to try another algorithm or a smaller workspace). libexpseg_torch.so
    throws that type; it is built against one PyTorch's headers and libc10, so it is used only under that
    version. Otherwise expseg_torch_malloc of libexpseg.so throws a std::bad_alloc: a RuntimeError."""
    fallback = (_lib_path, "expseg_torch_malloc", "expseg_free", RuntimeError)
    path = _torch_library_path()
    if path is None:
        return fallback
    running = str(getattr(torch, "__version__", ""))
    try:
        shim = ctypes.CDLL(path)
        shim.expseg_torch_c10_built_for.restype = ctypes.c_char_p
        built_for = shim.expseg_torch_c10_built_for().decode("utf-8", "replace")
    except (OSError, AttributeError) as e:
        why = "cannot be loaded here (%s)" % e
    else:
        if built_for == running:
            return (path, "expseg_torch_c10_malloc", "expseg_torch_c10_free", torch.cuda.OutOfMemoryError)
        why = "was built for PyTorch %s, and this is PyTorch %s" % (built_for, running)
    import warnings
    warnings.warn("expseg.install_torch: %s %s: an OOM raises RuntimeError, not torch.cuda.OutOfMemoryError, and "
                  "PyTorch's own OOM recoveries (cuDNN's smaller workspaces) do not run. Rebuild expseg where this "
                  "PyTorch's python3 is on PATH (meson setup --reconfigure BUILD_DIR && ninja -C BUILD_DIR) to get "
                  "them back" % (path, why),
                  RuntimeWarning, stacklevel=3)
    return fallback


def _configure_for(who, conf):
    """install_torch / install_cupy: applies `conf` unless it is empty (keep what is configured) or the
    other framework was installed with it (PyTorch and CuPy share expseg's allocators)."""
    if not conf:
        return
    other_conf = _cupy_conf if who == "install_torch" else (_torch_conf[0] if _torch_conf else None)
    if conf == other_conf:
        return
    if other_conf:
        # configure() replaces the configuration: the other framework's string would be dropped without a word.
        other = "install_cupy" if who == "install_torch" else "install_torch"
        raise ExpsegError("expseg.%s(%r): expseg.%s(%r) configured the allocators PyTorch and CuPy share; install "
                          "both with the same configuration, or pass none to this one to keep it" % (who, conf, other, other_conf),
                          ALREADY_INITIALIZED)
    try:
        configure(conf)
    except ExpsegError as e:
        if e.code != ALREADY_INITIALIZED:
            raise
        raise ExpsegError("expseg.%s(%r): an expseg allocator already exists (%s), so the configuration can no "
                          "longer change; call %s with the configuration first, or pass no conf to use the one "
                          "in place (expseg.config() shows it)" % (who, conf, e, who), ALREADY_INITIALIZED) from None


def _cupy_out_of_memory(cupy_memory, size, device):
    """cupy.cuda.memory.OutOfMemoryError carrying expseg's report (its text, and .expseg_report)."""
    # This thread's report, not the device's last one: another thread's OOM may have replaced that since.
    lib = load()
    report = json.loads(_text(lib.expseg_thread_oom_report_json(device), "expseg_thread_oom_report_json")) or {}
    err = cupy_memory.OutOfMemoryError(size, report.get("reserved_bytes", 0), report.get("limit_bytes", 0))
    text = report.get("message", "")
    # No report (host memory ran out, a driver error): the thread's error message says what happened.
    said = text or (lib.expseg_last_error() or b"").decode("utf-8", "replace")
    if said:
        # Under policy:cupy the report's first line is CuPy's own message; otherwise put CuPy's first.
        err.args = (said if said.startswith("Out of memory allocating") else "%s\n%s" % (err.args[0], said),)
    err.expseg_report = text
    return err


def install_cupy(conf=""):
    """Makes expseg CuPy's allocator (CFunctionAllocator + cupy.cuda.set_allocator); OOM raises cupy's OutOfMemoryError.

    CuPy passes no stream to the allocator: each allocation is made for CuPy's current stream
    (cupy.cuda.get_current_stream()), through a CFunctionAllocator whose param is that stream, so that a block
    freed after work on one stream is not handed to another before that work is done.
    """
    global _cupy_allocator, _cupy_conf
    cupy = _import("cupy", "install_cupy", "CuPy", "pip install cupy-cuda12x, for CUDA 12")
    from cupy.cuda import memory as cupy_memory
    if _cupy_allocator is not None:
        if conf == _cupy_conf:
            return _cupy_allocator
        raise ExpsegError("expseg.install_cupy: already installed with %r; the configuration cannot change "
                          "in this process" % _cupy_conf, ALREADY_INITIALIZED)
    lib = load()
    _configure_for("install_cupy", conf)
    malloc_fn = ctypes.cast(lib.expseg_cupy_malloc, ctypes.c_void_p).value
    free_fn = ctypes.cast(lib.expseg_cupy_free, ctypes.c_void_p).value
    per_stream = {}  # stream pointer -> its CFunctionAllocator (param: the stream expseg allocates for)
    get_current_stream = cupy.cuda.get_current_stream

    def expseg_cupy_alloc(size):
        stream = get_current_stream().ptr
        cfa = per_stream.get(stream)
        if cfa is None:
            cfa = per_stream[stream] = cupy_memory.CFunctionAllocator(stream, malloc_fn, free_fn, lib)
        # CuPy does not check the C function's result: NULL must become an exception here.
        mem = cfa.malloc(size)
        if size and not mem.ptr:
            device = cupy.cuda.runtime.getDevice()
            if lib.expseg_last_error_code() == OUT_OF_MEMORY:
                raise _cupy_out_of_memory(cupy_memory, size, device)
            raise _error("expseg_cupy_malloc")
        return mem

    cupy.cuda.set_allocator(expseg_cupy_alloc)
    _cupy_allocator, _cupy_conf = expseg_cupy_alloc, conf
    return expseg_cupy_alloc
