/* expseg C API: the allocator behind a plain C ABI, for PyTorch, CuPy, ctypes and any C caller.
 *
 * Needs no CUDA header: streams are opaque pointers (expseg_stream_t is ABI-compatible with
 * cudaStream_t and CUstream; NULL is the legacy default stream). C and C++ compatible.
 *
 *   PyTorch  torch.cuda.memory.CUDAPluggableAllocator("libexpseg.so", "expseg_malloc", "expseg_free")
 *            + torch.cuda.memory.change_current_allocator(...)   (before any CUDA tensor exists)
 *   CuPy     cupy.cuda.memory.CFunctionAllocator(<stream>, <expseg_cupy_malloc>, <expseg_cupy_free>, owner)
 *            per stream + cupy.cuda.set_allocator(...)   (see expseg_cupy_malloc)
 *   Python   tools/expseg.py does both (install_torch / install_cupy) and wraps the rest.
 *
 * State. One allocator per device index (0 .. EXPSEG_MAX_DEVICES-1), created on first use (the
 * first malloc, set_limit, record_start, enable_peer_access, ipc_import, begin_graph_pool,
 * prepare_capture or begin_pool_allocations for that device) from
 * the configuration: the defaults, then EXPSEG_ALLOC_CONF, then the string given to
 * expseg_configure(), as they are when the first allocator is created; every later one gets that
 * same configuration (changing the variable afterwards reaches no device). Creation is thread-safe;
 * after it, malloc/free take no lock of the C API, only the allocator's own. Allocators live until
 * the process exits (they are never destroyed, so frees that arrive during interpreter or library
 * teardown stay valid); the operating system reclaims device memory at exit. Queries (stats,
 * snapshot, OOM report, limit) never create an allocator: for a device without one they answer
 * "nothing yet" (zero stats, a snapshot without segments, no report) or what it will be created
 * with (limit). The snapshot and the limit read the device's memory from the driver (see
 * expseg_get_limit): where the driver cannot be used, they fail with EXPSEG_ERROR_DRIVER.
 *
 * Errors. No C++ exception ever crosses this boundary. Calls that return int return EXPSEG_SUCCESS
 * (0) or one of the expseg_status codes; calls that return a pointer return NULL on error. Every
 * failure records a message and a code for the calling thread, read with expseg_last_error() and
 * expseg_last_error_code(); successful calls leave them unchanged (errno-style), and
 * expseg_clear_error() resets them. Out of memory: malloc returns NULL, the code is
 * EXPSEG_ERROR_OUT_OF_MEMORY, and the full report (why: capacity, limit or fragmentation, with the
 * numbers) stays retrievable with expseg_last_oom_report(device) from any thread (until the device's
 * next OOM, maybe another thread's) and with expseg_thread_oom_report(device) from the failing thread.
 *
 * Strings. Every returned const char* is owned by expseg and points to a buffer of the calling
 * thread, one buffer per function: it stays valid until the same function is called again on the
 * same thread, or the thread exits. Copy it to keep it longer. Never free it.
 */
#ifndef EXPSEG_EXPSEG_H
#define EXPSEG_EXPSEG_H

#include <stddef.h>    /* size_t */
#include <sys/types.h> /* ssize_t (POSIX) */

#define EXPSEG_VERSION_MAJOR 0
#define EXPSEG_VERSION_MINOR 1
#define EXPSEG_VERSION_PATCH 0
#define EXPSEG_VERSION_STRING "0.1.0"

/* Devices 0 .. EXPSEG_MAX_DEVICES-1 can have an allocator. */
#define EXPSEG_MAX_DEVICES 64

#if defined(__GNUC__) || defined(__clang__)
#define EXPSEG_API __attribute__((visibility("default")))
#else
#define EXPSEG_API
#endif

#ifdef __cplusplus
#define EXPSEG_NOEXCEPT noexcept
extern "C" {
#else
#define EXPSEG_NOEXCEPT
#endif

/* A cudaStream_t / CUstream, passed through untouched; NULL is the legacy default stream. */
typedef void* expseg_stream_t;

/* Status codes returned by the int-returning calls and by expseg_last_error_code(). */
enum expseg_status {
  EXPSEG_SUCCESS = 0,
  EXPSEG_ERROR_INVALID_ARGUMENT = 1,    /* a NULL path, a negative size, ... */
  EXPSEG_ERROR_INVALID_DEVICE = 2,      /* device index outside 0 .. EXPSEG_MAX_DEVICES-1 */
  EXPSEG_ERROR_CONFIG = 3,              /* a bad configuration string: the message names the key */
  EXPSEG_ERROR_ALREADY_INITIALIZED = 4, /* expseg_configure after an allocator was created */
  EXPSEG_ERROR_OUT_OF_MEMORY = 5,       /* see expseg_last_oom_report(); also a driver call out of memory outside an allocation (an IPC import, a peer mapping), which has no report */
  EXPSEG_ERROR_INVALID_POINTER = 6,     /* free/record_stream/ipc_export of a pointer that is not a live
                                           allocation, ipc_close of one that is not an open import */
  EXPSEG_ERROR_DRIVER = 7,              /* a CUDA driver call failed (or no usable driver/device) */
  EXPSEG_ERROR_IO = 8,                  /* a trace file could not be written */
  EXPSEG_ERROR_INTERNAL = 9,            /* anything else; the message says what */
  EXPSEG_ERROR_IPC = 10                 /* IPC: a malformed or mismatched handle, an allocator that cannot
                                           export as configured, descriptors refused (the message says which) */
};

/* ---------------------------------------------------------------------------------------------
 * Allocation: PyTorch's CUDAPluggableAllocator pair.
 * expseg_malloc: `size` bytes on `device` for use on `stream`. Size 0 returns NULL (no error). A
 * negative size (PyTorch passes a size_t: 2^63 bytes or more) is EXPSEG_ERROR_INVALID_ARGUMENT,
 * without an OOM report; 1 EiB up to that is refused as out of memory, with its report.
 * On out of memory returns NULL and also prints the OOM report on stderr, because PyTorch's
 * pluggable allocator does not check for NULL (the next kernel then fails with an illegal address).
 * expseg_free: `size` and `stream` are ignored (expseg keeps its own record); free(NULL) does
 * nothing; freeing a pointer that is not a live allocation of `device` records
 * EXPSEG_ERROR_INVALID_POINTER and changes nothing. Where the events that make a block used on
 * other streams (expseg_record_stream) wait for their work cannot be made or recorded, each stream
 * that used the block is synchronized (the device only if that fails) and the block freed at once
 * (no caller retries a free; C++'s deallocate throws and leaves the block live instead); only if
 * the synchronization fails too is the error recorded and the block left live. */
EXPSEG_API void* expseg_malloc(ssize_t size, int device, expseg_stream_t stream) EXPSEG_NOEXCEPT;
EXPSEG_API void expseg_free(void* ptr, ssize_t size, int device, expseg_stream_t stream) EXPSEG_NOEXCEPT;

#ifdef __cplusplus
/* For PyTorch's CUDAPluggableAllocator only (a C++ caller; never call it from C): expseg_malloc
 * that throws instead of returning NULL. Out of memory throws expseg::out_of_memory (a
 * std::bad_alloc whose what() is the OOM report), other failures std::runtime_error or
 * std::invalid_argument; PyTorch turns them into a Python RuntimeError carrying the message, as it
 * documents for pluggable allocators, instead of handing out a tensor at address 0. The report and
 * the error code stay retrievable as after expseg_malloc. PyTorch takes only c10::OutOfMemoryError
 * for an OOM (torch.cuda.OutOfMemoryError): libexpseg_torch.so (lib/torch/, built where PyTorch is
 * found) wraps this function as expseg_torch_c10_malloc, which rethrows an OOM as that type.
 * tools/expseg.py: install_torch(conf) installs that one where it was built for the running
 * PyTorch, else this one (raise_on_oom=False: expseg_malloc). */
EXPSEG_API void* expseg_torch_malloc(ssize_t size, int device, expseg_stream_t stream);
#endif

/* Allocation: CuPy's CFunctionAllocator pair. CuPy passes no stream, so `param` is the stream to
 * allocate for (a CUstream; 0: the legacy default stream): a CFunctionAllocator per stream, made
 * with that stream as its param, and the one of CuPy's current stream used for each allocation, as
 * tools/expseg.py's install_cupy does. Blocks are then reused in their stream's order and handed to
 * another stream only once their stream's work is done, as CuPy's own pool keeps them per stream
 * (with one allocator of param 0, work on other streams could still be using a block handed out
 * again). The stream may be destroyed while memory stays cached for it (CuPy destroys a Stream
 * when it is collected): expseg never calls the driver with it and waits for its work with a device
 * synchronization where it must. `param` of expseg_cupy_free is ignored. Out of memory returns NULL
 * silently (tools/expseg.py turns it into cupy's OutOfMemoryError). */
EXPSEG_API void* expseg_cupy_malloc(void* param, size_t size, int device_id) EXPSEG_NOEXCEPT;
EXPSEG_API void expseg_cupy_free(void* param, void* ptr, int device_id) EXPSEG_NOEXCEPT;

/* Out-of-memory callback, for every device: called at each OOM of expseg_malloc,
 * expseg_torch_malloc and expseg_cupy_malloc, on the allocating thread, after the allocator's lock
 * is released and before the call returns NULL (or throws). `report_json` is the OOM report as
 * expseg_last_oom_report_json gives it, valid during the call only. The callback may call expseg
 * (expseg_snapshot_json, expseg_release_cached, ...); an OOM of its own allocations is not reported
 * to it again. Its calls share the thread's string buffers (see Strings above): a string the thread
 * took from expseg_snapshot_json before an allocation is no longer valid after that allocation if
 * the callback called expseg_snapshot_json too. A NULL callback removes it; each call replaces
 * the previous one; a call already running on another thread may still be running when
 * expseg_set_oom_callback returns, so keep the previous callback's user_data valid (e.g. for the
 * life of the process). Typical use: save a snapshot, or log the report where the job's logs go.
 * (The oom_dump:PATH config key writes report, snapshot and recorded events to a file without code.)
 * A request of 1 EiB or more is refused up front, as PyTorch refuses it: NULL and the report, but
 * no callback, no num_ooms and no dump. */
typedef void (*expseg_oom_callback)(int device, const char* report_json, void* user_data);
EXPSEG_API int expseg_set_oom_callback(expseg_oom_callback callback, void* user_data) EXPSEG_NOEXCEPT;

/* The live allocation `ptr` of `device` is also used by work on `stream`: when it is freed, its
 * memory is reused only after the work queued on `stream` up to the free has completed. NULL (an
 * empty tensor) does nothing, as expseg_free(NULL). */
EXPSEG_API int expseg_record_stream(void* ptr, int device, expseg_stream_t stream) EXPSEG_NOEXCEPT;

/* ---------------------------------------------------------------------------------------------
 * Configuration. `conf` has EXPSEG_ALLOC_CONF's syntax ("backend:expandable,limit:20GiB"; PyTorch's
 * PYTORCH_CUDA_ALLOC_CONF keys are accepted) and is applied over EXPSEG_ALLOC_CONF for every
 * allocator created afterwards. Each call replaces the previous call's string (NULL or "" goes
 * back to EXPSEG_ALLOC_CONF alone). The string is checked at once: EXPSEG_ERROR_CONFIG names the
 * bad key. Allowed only while no device has an allocator yet, else EXPSEG_ERROR_ALREADY_INITIALIZED. */
EXPSEG_API int expseg_configure(const char* conf) EXPSEG_NOEXCEPT;
/* The configuration of `device`'s allocator in canonical key:value form, or the one it would be
 * created with. NULL on error. */
EXPSEG_API const char* expseg_config(int device) EXPSEG_NOEXCEPT;
/* 1 when `device` has an allocator, 0 when not, -1 for an invalid device index. */
EXPSEG_API int expseg_device_initialized(int device) EXPSEG_NOEXCEPT;

/* Gives every cached byte that can be given back to the device (PyTorch's empty_cache()). */
EXPSEG_API int expseg_release_cached(int device) EXPSEG_NOEXCEPT;
/* Before destroying a stream the program created with memory cached for it (see
 * Allocator::release_stream): synchronizes it, gives back what is cached for it and forgets it,
 * both what expseg_malloc/expseg_torch_malloc cached for it and what expseg_cupy_malloc did (a
 * CFunctionAllocator's stream). EXPSEG_ERROR_INVALID_ARGUMENT, nothing changed, while blocks
 * allocated on it by either are in use or have it recorded, for the default, legacy or per-thread
 * stream, or while it captures. Blocks it allocated into a graph pool belong to the pool: they do
 * not hold the stream. */
EXPSEG_API int expseg_release_stream(int device, expseg_stream_t stream) EXPSEG_NOEXCEPT;
/* CUDA graphs' private pools (see Allocator::begin_graph_pool): while `stream` captures, after
 * expseg_begin_graph_pool(device, pool, stream) and until expseg_end_graph_pool(device, pool), the
 * capture's allocations come from pool `pool` (nonzero), whose memory nothing else gets until
 * expseg_release_graph_pool(device, pool) has dropped every begin's use. End the pool after the
 * capture ends; release it when the graph is destroyed. Creates the allocator when needed.
 * EXPSEG_ERROR_INVALID_ARGUMENT, nothing changed, for misuse (a stream not capturing, pool 0, a pool
 * not begun or released already, an end while the capture still runs, a release while a capture
 * allocates into the pool), except that begin (for a pool other than 0, which is refused first) and
 * prepare create the device's allocator when it has none (so a later expseg_configure is refused)
 * even when they then refuse; the other calls never create the allocator.
 * EXPSEG_ERROR_DRIVER from expseg_end_graph_pool: the end is done all the same (do not end the pool
 * again), but frees held during the capture could not be completed; they stay held and are retried
 * at the next end, expseg_release_cached, or a request that would otherwise run out of memory. */
EXPSEG_API int expseg_begin_graph_pool(int device, unsigned long long pool, expseg_stream_t stream) EXPSEG_NOEXCEPT;
/* Optional, just before the capture on `stream` begins (see Allocator::prepare_capture): asks whether
 * the stream blocks, so that during the capture the expandable backend may take back idle memory of
 * the legacy stream, other threads' per-thread streams and blocking CuPy streams when it does not.
 * EXPSEG_ERROR_INVALID_ARGUMENT, nothing changed, for a stream that captures already. */
EXPSEG_API int expseg_prepare_capture(int device, expseg_stream_t stream) EXPSEG_NOEXCEPT;
EXPSEG_API int expseg_end_graph_pool(int device, unsigned long long pool) EXPSEG_NOEXCEPT;
EXPSEG_API int expseg_release_graph_pool(int device, unsigned long long pool) EXPSEG_NOEXCEPT;
/* Outside a capture (see Allocator::begin_pool_allocations): until expseg_end_pool_allocations, the
 * requests on `stream` come from graph pool `pool`, as PyTorch's CUDA graph trees warm graphs up.
 * Takes a use of the pool, which expseg_release_graph_pool drops. EXPSEG_ERROR_INVALID_ARGUMENT,
 * nothing changed, for pool 0, a capturing stream or one that allocates into a pool already (as
 * with begin_graph_pool, the device's allocator is created first when it has none). */
EXPSEG_API int expseg_begin_pool_allocations(int device, unsigned long long pool, expseg_stream_t stream) EXPSEG_NOEXCEPT;
EXPSEG_API int expseg_end_pool_allocations(int device, unsigned long long pool, expseg_stream_t stream) EXPSEG_NOEXCEPT;
/* Allocates exactly [ptr, ptr + size) again in graph pool `pool` (see
 * Allocator::restore_graph_pool_block: PyTorch's setCheckpointPoolState); freed with expseg_free.
 * EXPSEG_ERROR_INVALID_ARGUMENT, nothing changed, when the range is not free memory of the pool. */
EXPSEG_API int expseg_restore_graph_pool_block(int device, unsigned long long pool, void* ptr, size_t size) EXPSEG_NOEXCEPT;
/* The allocated blocks of graph pool `pool` (see Allocator::graph_pool_blocks): the first `capacity`
 * of them, by address, into addresses[] and sizes[] (either may be NULL when capacity is 0), and
 * their number into *count (which may exceed capacity: call again with more room). */
EXPSEG_API int expseg_graph_pool_blocks(int device, unsigned long long pool, unsigned long long* addresses, size_t* sizes,
                                        size_t capacity, size_t* count) EXPSEG_NOEXCEPT;
/* Bytes of device memory `device`'s allocator may hold; 0 removes the limit. Creates the allocator
 * when needed. Lowering the limit gives back cached memory above it at once (see
 * Allocator::set_limit). EXPSEG_ERROR_INVALID_ARGUMENT, nothing changed, while a capture allocates
 * into a graph pool (giving memory back would invalidate it); expseg_release_cached likewise. */
EXPSEG_API int expseg_set_limit(int device, size_t bytes) EXPSEG_NOEXCEPT;
/* The limit of `device`'s allocator (0: none) and the device's total memory, for PyTorch's
 * get/set_per_process_memory_fraction; either pointer may be NULL. A query: it never creates the
 * allocator. For a device without one, the limit it will be created with (the configuration's,
 * a fraction resolved against the device's memory as the allocator resolves it) and the device's
 * memory, read from the driver (on CUDA, cuMemGetInfo in the device's primary context, which this
 * initialises if nothing has yet); the same answers as once the allocator exists. */
EXPSEG_API int expseg_get_limit(int device, size_t* limit_bytes, size_t* device_total_bytes) EXPSEG_NOEXCEPT;
/* Peaks down to the current values (PyTorch's reset_peak_memory_stats()). */
EXPSEG_API int expseg_reset_peak_stats(int device) EXPSEG_NOEXCEPT;
/* The accumulated counters (each stat's allocated/freed, num_alloc_retries, num_ooms, ...) start
 * afresh (PyTorch's reset_accumulated_memory_stats()): a stat's allocated and freed restart at 0, as
 * PyTorch's do, so allocated - freed is what was allocated and not freed since (current minus its
 * value at the reset). */
EXPSEG_API int expseg_reset_accumulated_stats(int device) EXPSEG_NOEXCEPT;

/* ---------------------------------------------------------------------------------------------
 * Observability (JSON is one object per call, UTF-8).
 * stats: PyTorch's memory_stats() keys ("allocated_bytes.all.peak", "reserved_bytes.all.current",
 *   "num_alloc_retries", ...) plus a "cupy" object {used_bytes, total_bytes, free_bytes, n_free_blocks}.
 * snapshot: {backend, device, limit_bytes, device_total_bytes, segments: [{address, size, blocks: [...]}], stats}.
 * last OOM report: the text (its first sentence reads like PyTorch's "CUDA out of memory. Tried to
 *   allocate ...", or CuPy's "Out of memory allocating ..." under policy:cupy) or JSON; "" (text) / "null" (JSON) when `device` has had no OOM. */
EXPSEG_API const char* expseg_stats_json(int device) EXPSEG_NOEXCEPT;
EXPSEG_API const char* expseg_snapshot_json(int device) EXPSEG_NOEXCEPT;
EXPSEG_API const char* expseg_last_oom_report(int device) EXPSEG_NOEXCEPT;
EXPSEG_API const char* expseg_last_oom_report_json(int device) EXPSEG_NOEXCEPT;
/* The report of the calling thread's last allocation on `device` (expseg_malloc,
 * expseg_torch_malloc, expseg_cupy_malloc) that failed with out of memory, text or JSON as above:
 * what a thread turns into its own error (tools/expseg.py's CuPy OutOfMemoryError), since the
 * device's last report may by then be another thread's. "" / "null" when this thread has had no
 * OOM on `device`, or its last failed allocation there had no report (host memory ran out, a driver
 * error, no allocator could be created). Kept until this thread's next failed allocation on `device`. */
EXPSEG_API const char* expseg_thread_oom_report(int device) EXPSEG_NOEXCEPT;
EXPSEG_API const char* expseg_thread_oom_report_json(int device) EXPSEG_NOEXCEPT;

/* Event recorder: every alloc/free (and map/unmap, failed allocation) with a timestamp.
 * record_start creates the allocator when needed and starts afresh (earlier events are dropped);
 * ring > 0 keeps only the last `ring` events. record_write writes what was recorded so far (also
 * after record_stop) as RMM's CSV log, gzip-compressed when `path` ends in ".gz"; `expseg replay`
 * and read_trace() read it back. A regular file (or none) at `path` is replaced whole (written
 * beside it, then renamed): a failed write leaves the earlier file as it was. */
EXPSEG_API int expseg_record_start(int device, size_t ring) EXPSEG_NOEXCEPT;
EXPSEG_API int expseg_record_stop(int device) EXPSEG_NOEXCEPT;
/* Whether allocators created from now on start with the recorder on (ring as for record_start), as
 * record:true,record_ring:N in the configuration would; allocators that exist are not changed
 * (record_start / record_stop them). PyTorch's _record_memory_history under tools/expseg.py uses it
 * so that devices first used later record too. */
EXPSEG_API int expseg_set_record_default(int on, size_t ring) EXPSEG_NOEXCEPT;
EXPSEG_API int expseg_record_write(int device, const char* path) EXPSEG_NOEXCEPT;
/* *partial = 1 when what record_write writes does not start from an empty allocator (the recording
 * began while memory was allocated or cached, or a full ring dropped its oldest events): its replay
 * starts from another state, and needs `expseg replay --lenient` where it frees blocks it never saw
 * allocated; 0 when it does start there (or `device` has no allocator yet). */
EXPSEG_API int expseg_record_partial(int device, int* partial) EXPSEG_NOEXCEPT;
/* expseg_snapshot_json and expseg_record_write of one moment (one lock, taken once): the events
 * written to `trace_path` end where the returned snapshot stands, which a viewer that walks the
 * events back from the snapshot needs (tools/expseg.py's torch_snapshot() for PyTorch's memory_viz);
 * separate calls may see other threads' allocations in between. NULL on failure (EXPSEG_ERROR_IO
 * when the file cannot be written). The string is the one expseg_snapshot_json returns. */
EXPSEG_API const char* expseg_snapshot_json_with_trace(int device, const char* trace_path) EXPSEG_NOEXCEPT;

/* ---------------------------------------------------------------------------------------------
 * Several GPUs and several processes (C++: Allocator::enable_peer_access, expseg/ipc.hpp).
 *
 * expseg_enable_peer_access: lets device `peer` read and write everything `device`'s allocator
 * maps, now and later; creates the allocator when needed (not for a `peer` that is not a visible
 * device: that is refused first). Expandable memory is granted with
 * cuMemSetAccess (to any number of peers); split_merge memory, reached through contexts, needs
 * cuCtxEnablePeerAccess, which CUDA allows for at most 8 peers of a device (then
 * EXPSEG_ERROR_DRIVER, CUDA_ERROR_TOO_MANY_PEERS). `peer` == `device`, or a peer enabled before,
 * does nothing. EXPSEG_ERROR_INVALID_DEVICE: `device` or `peer` out of range, `peer` not a visible
 * device, or no peer-to-peer path from `peer` to `device` (cuDeviceCanAccessPeer). */
EXPSEG_API int expseg_enable_peer_access(int device, int peer) EXPSEG_NOEXCEPT;

/* IPC: hand a live allocation to another process (PyTorch's own cudaIpcGetMemHandle sharing does
 * not work through a pluggable allocator; these do, for both backends).
 *
 * expseg_ipc_export: the live allocation that starts at `ptr` on `device` as a handle: `*handle`
 *   points to `*handle_size` bytes that may travel any way (a pipe, a queue, a file). With
 *   ipc_handle:posix_fd (expandable) the handle also needs file descriptors: `*fds` points to
 *   `*nfds` descriptors (0 and NULL for split_merge and for ipc_handle:fabric; but where the device
 *   refuses fabric handles, e.g. in a container without IMEX channels, an ipc_handle:fabric
 *   allocator's memory uses posix_fd handles and its exports carry descriptors). Both buffers belong
 *   to the calling thread and stay valid until its next expseg_ipc_export. The descriptors are the
 *   caller's: send them with the bytes (SCM_RIGHTS over a Unix socket, e.g. expseg.ipc_send in
 *   Python), or keep them open until the importer has taken them with pidfd_getfd; then
 *   close them (an open descriptor keeps the physical memory alive). The allocation must stay
 *   allocated until every importer has closed it. An expandable allocator exports only when
 *   configured with ipc_handle:posix_fd or ipc_handle:fabric (else EXPSEG_ERROR_IPC, saying so).
 *   EXPSEG_ERROR_INVALID_POINTER: `ptr` is not the start of a live allocation of `device`;
 *   EXPSEG_ERROR_INVALID_ARGUMENT: a NULL output pointer.
 * expseg_ipc_import: maps an exported allocation into this process on `device`, through that
 *   device's allocator (created when needed; its peers reach the memory too), and sets `*ptr` (and
 *   `*size` when not NULL) to the allocation's start and size here (NULL and 0 on error). `fds`
 *   are the `nfds` descriptors received with the handle, in order; they stay the caller's (close
 *   them after the call). With nfds 0 a posix_fd handle's descriptors are taken from the exporting
 *   process with pidfd_getfd (Linux >= 5.6, needs ptrace access to it and both processes in one
 *   PID namespace: a handle from another container is refused, naming the fallback). A split_merge handle
 *   cannot be imported by the process that exported it (CUDA refuses); a simulated device's handle
 *   is imported only by the allocator that exported it (same process, same device), and without
 *   sim_host_backed its descriptors are placeholder numbers that name no file (pass them back to
 *   expseg_ipc_import as they are; closing or sending them fails with EBADF). A descriptor that
 *   names another file than the exporter's (another handle's, or a number the exporter reused after
 *   closing its own) is refused with EXPSEG_ERROR_IPC. What can be
 *   checked without the allocator is checked before it is created, so a refused import leaves the
 *   device as it was. EXPSEG_ERROR_IPC: malformed bytes, the wrong number of descriptors, a handle
 *   of another device kind, a handle the process or device cannot import as just said, pidfd_getfd
 *   refused (the message names the way out); EXPSEG_ERROR_INVALID_ARGUMENT: NULL `ptr`, no handle
 *   bytes, NULL `fds` with nfds > 0, a negative descriptor or one that is not open, descriptors for
 *   a handle that takes none.
 * expseg_ipc_close: unmaps memory that expseg_ipc_import mapped on `device` (`ptr` as it was
 *   returned), once the work queued on `device` is done, as cudaIpcCloseMemHandle waits for it (work
 *   of peer devices on it is the caller's to finish first). NULL does nothing.
 *   EXPSEG_ERROR_INVALID_POINTER: `ptr` is not an open import of `device`.
 * All three are thread-safe. */
EXPSEG_API int expseg_ipc_export(void* ptr, int device, const void** handle, size_t* handle_size, const int** fds,
                                 size_t* nfds) EXPSEG_NOEXCEPT;
EXPSEG_API int expseg_ipc_import(const void* handle, size_t handle_size, const int* fds, size_t nfds, int device,
                                 void** ptr, size_t* size) EXPSEG_NOEXCEPT;
EXPSEG_API int expseg_ipc_close(void* ptr, int device) EXPSEG_NOEXCEPT;

/* ---------------------------------------------------------------------------------------------
 * Errors and version. */
EXPSEG_API const char* expseg_last_error(void) EXPSEG_NOEXCEPT; /* "" when none */
EXPSEG_API int expseg_last_error_code(void) EXPSEG_NOEXCEPT;    /* EXPSEG_SUCCESS when none */
EXPSEG_API void expseg_clear_error(void) EXPSEG_NOEXCEPT;
EXPSEG_API const char* expseg_version(void) EXPSEG_NOEXCEPT;     /* EXPSEG_VERSION_STRING */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* EXPSEG_EXPSEG_H */
