//! Minimal NCCL bindings for averaging gradients between CUDA trainers: the NCCL and CUDA
//! runtime libraries that libtorch_cuda already loaded, found by soname at run time.
//!
//! libtorch_cuda.so has `NEEDED libnccl.so.2` and `libcudart.so.13` (with an rpath to the
//! wheel's `nvidia/*/lib` folders) and our binaries link it with `--no-as-needed`, so
//! `dlopen("libnccl.so.2")` returns the copy that is already in the process. Only the calls
//! a data-parallel trainer needs are bound: unique ids, communicator set-up and tear-down,
//! in-place float sum allreduce and broadcast on the legacy default stream (the stream
//! libtorch uses by default), and the asynchronous error check.
//!
//! Communicators are non-blocking (`ncclConfig_t::blocking = 0`): `ncclCommInitRankConfig`
//! returns at once and the rank polls `ncclCommGetAsyncError` until the communicator is
//! ready, or aborts it once a deadline passes ([`NcclError::InitTimeout`]), so a bootstrap
//! that stalls (a rank that never started, a blocked port) fails the rank instead of
//! hanging it. NCCL has no call that makes a communicator blocking after its creation, so
//! every later call that answers `ncclInProgress` (a collective still being enqueued,
//! finalize) is polled to completion the same way before the next call.

// FFI into NCCL and the CUDA runtime cannot be done without unsafe code; every block says
// why it is sound.
#![allow(unsafe_code)]

use std::cell::Cell;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::fmt;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libloading::Library;
use tch::{Device, Kind, Tensor};

/// The environment variable naming an NCCL library (a path) to try before the sonames.
pub const LIBRARY_ENV: &str = "IMGRUN_NCCL_LIBRARY";

/// The sonames tried, in order, after [`LIBRARY_ENV`].
const NCCL_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];
/// The CUDA runtime sonames tried, in order.
const CUDART_NAMES: [&str; 3] = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"];

/// Bytes in an `ncclUniqueId` (`NCCL_UNIQUE_ID_BYTES`).
const UNIQUE_ID_BYTES: usize = 128;

/// `ncclFloat32` in `ncclDataType_t`.
const NCCL_FLOAT32: c_int = 7;
/// `ncclSum` in `ncclRedOp_t`.
const NCCL_SUM: c_int = 0;
/// `ncclSuccess`.
const NCCL_SUCCESS: c_int = 0;
/// `ncclInProgress`: a non-blocking communicator is still working (not an error).
const NCCL_IN_PROGRESS: c_int = 7;
/// `NCCL_CONFIG_UNDEF_INT` (`INT_MIN`): a config field NCCL chooses itself.
const CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// The magic number `NCCL_CONFIG_INITIALIZER` puts in `ncclConfig_t::magic`.
const CONFIG_MAGIC: c_uint = 0xcafe_beef;
/// The NCCL version whose `ncclConfig_t` [`RawConfig`] transcribes (2.28.9, the
/// `nvidia-nccl` wheel torch 2.11 ships), as `NCCL_VERSION(2, 28, 9)`.
const CONFIG_LAYOUT_VERSION: c_int = 22809;
/// The pause between two polls of a non-blocking communicator's state.
const POLL_PAUSE: Duration = Duration::from_millis(1);

/// Why an NCCL call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NcclError {
    #[error("cannot load the NCCL library (tried {tried}): {error}")]
    Load { tried: String, error: String },
    #[error("the library {library} lacks {symbol}: {error}")]
    Symbol {
        library: String,
        symbol: &'static str,
        error: String,
    },
    #[error("{call} failed with CUDA error {code}: {message}")]
    Cuda {
        call: &'static str,
        code: i32,
        message: String,
    },
    #[error("{call} failed with NCCL error {code}: {message}")]
    Call {
        call: &'static str,
        code: i32,
        message: String,
    },
    #[error(
        "rank {rank} of {world}: the NCCL communicator was not ready after {waited:?} (half \
         of train.step_timeout_secs); check that every rank started, that \
         NCCL_SOCKET_IFNAME names an interface the ranks reach each other on, and that no \
         firewall blocks the ports NCCL opens between the nodes"
    )]
    InitTimeout {
        rank: usize,
        world: usize,
        waited: Duration,
    },
    #[error("{call} did not complete within {waited:?}; the communicator was given up")]
    CallTimeout {
        call: &'static str,
        waited: Duration,
    },
    #[error("rank {rank} of a world of {world} is invalid")]
    Rank { rank: usize, world: usize },
    #[error("bad NCCL unique id: {0}")]
    Id(String),
    #[error("bad tensor for NCCL: {0}")]
    Tensor(String),
}

/// `ncclUniqueId`: `char internal[128]`, passed by value to `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawUniqueId {
    internal: [u8; UNIQUE_ID_BYTES],
}

/// `ncclConfig_t` as NCCL 2.28.9's nccl.h declares it (`ncclConfig_v22800`): 80 bytes on
/// 64-bit Linux, checked by a unit test against offsets measured with the header. Fields
/// are only ever appended to it, and NCCL reads the ones of the `version` the caller says
/// it filled in, so an older library reads the prefix it knows.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RawConfig {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
    traffic_class: c_int,
    comm_name: *const c_char,
    collnet_enable: c_int,
    cta_policy: c_int,
    shrink_share: c_int,
    nvls_ctas: c_int,
    n_channels_per_net_peer: c_int,
    nvlink_centric_sched: c_int,
}

impl RawConfig {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`, for a library of `library_version`:
    /// the config's version is the older of the library's and this layout's, so neither
    /// side reads a field the other does not have.
    fn non_blocking(library_version: c_int) -> Self {
        let version = library_version.clamp(0, CONFIG_LAYOUT_VERSION) as c_uint;
        Self {
            size: std::mem::size_of::<Self>(),
            magic: CONFIG_MAGIC,
            version,
            blocking: 0,
            cga_cluster_size: CONFIG_UNDEF_INT,
            min_ctas: CONFIG_UNDEF_INT,
            max_ctas: CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: CONFIG_UNDEF_INT,
            traffic_class: CONFIG_UNDEF_INT,
            comm_name: std::ptr::null(),
            collnet_enable: CONFIG_UNDEF_INT,
            cta_policy: CONFIG_UNDEF_INT,
            shrink_share: CONFIG_UNDEF_INT,
            nvls_ctas: CONFIG_UNDEF_INT,
            n_channels_per_net_peer: CONFIG_UNDEF_INT,
            nvlink_centric_sched: CONFIG_UNDEF_INT,
        }
    }
}

/// `ncclComm_t`.
type RawComm = *mut c_void;
/// `cudaStream_t`.
type RawStream = *mut c_void;

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueIdFn = unsafe extern "C" fn(*mut RawUniqueId) -> c_int;
type CommInitRankConfigFn =
    unsafe extern "C" fn(*mut RawComm, c_int, RawUniqueId, c_int, *mut RawConfig) -> c_int;
/// `ncclAllReduce` (the fifth argument is the `ncclRedOp_t`) and `ncclBroadcast` (the
/// root rank): (send, receive, count, data type, op or root, communicator, stream).
type CollectiveFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> c_int;
type CommFn = unsafe extern "C" fn(RawComm) -> c_int;
type CommGetAsyncErrorFn = unsafe extern "C" fn(RawComm, *mut c_int) -> c_int;
type GetErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;
type GetLastErrorFn = unsafe extern "C" fn(RawComm) -> *const c_char;
type CudaSetDeviceFn = unsafe extern "C" fn(c_int) -> c_int;
type CudaGetErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;

/// The loaded NCCL and CUDA runtime libraries and the functions imgrun calls.
///
/// The function pointers are copied out of the libraries at load time; they stay valid
/// while the libraries are loaded, which is for as long as this value lives (the one from
/// [`library`] lives for the whole process).
pub struct Nccl {
    nccl_name: String,
    cudart_name: String,
    version_code: i32,
    get_unique_id: GetUniqueIdFn,
    comm_init_rank_config: CommInitRankConfigFn,
    all_reduce: CollectiveFn,
    broadcast: CollectiveFn,
    comm_finalize: CommFn,
    comm_destroy: CommFn,
    comm_abort: CommFn,
    comm_get_async_error: CommGetAsyncErrorFn,
    get_error_string: GetErrorStringFn,
    get_last_error: GetLastErrorFn,
    cuda_set_device: CudaSetDeviceFn,
    cuda_get_error_string: Option<CudaGetErrorStringFn>,
    // Declared last: dropped after nothing can call through the pointers above.
    _nccl: Library,
    _cudart: Library,
}

impl fmt::Debug for Nccl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nccl")
            .field("nccl", &self.nccl_name)
            .field("cudart", &self.cudart_name)
            .field("version", &self.version())
            .finish_non_exhaustive()
    }
}

/// The process's NCCL, loaded on first use: [`LIBRARY_ENV`] if set, then `libnccl.so.2`,
/// then `libnccl.so`; and the CUDA runtime (`libcudart.so.13`, `.12`, unversioned). A
/// failure is remembered and returned again.
pub fn library() -> Result<&'static Nccl, NcclError> {
    static LIBRARY: OnceLock<Result<Nccl, NcclError>> = OnceLock::new();
    LIBRARY
        .get_or_init(Nccl::load)
        .as_ref()
        .map_err(Clone::clone)
}

/// Opens the first of `names` that loads; returns it with the name that worked.
fn open_first(names: &[String]) -> Result<(Library, String), NcclError> {
    let mut errors = Vec::new();
    for name in names {
        // SAFETY: loading NCCL or the CUDA runtime runs their initialisers, which have no
        // preconditions; normally the libraries are already loaded by libtorch_cuda and
        // dlopen only takes another reference.
        match unsafe { Library::new(name) } {
            Ok(library) => return Ok((library, name.clone())),
            Err(error) => errors.push(error.to_string()),
        }
    }
    Err(NcclError::Load {
        tried: names.join(", "),
        error: errors.join("; "),
    })
}

/// Copies the function pointer `symbol` (NUL-terminated) out of `library`.
///
/// # Safety
/// `T` must be the `extern "C"` function pointer type of the C declaration of `symbol`.
unsafe fn symbol<T: Copy>(
    library: &Library,
    library_name: &str,
    symbol: &'static str,
) -> Result<T, NcclError> {
    let with_nul = format!("{symbol}\0");
    // SAFETY: the caller guarantees that `T` matches the symbol's C type.
    match unsafe { library.get::<T>(with_nul.as_bytes()) } {
        Ok(found) => Ok(*found),
        Err(error) => Err(NcclError::Symbol {
            library: library_name.to_string(),
            symbol,
            error: error.to_string(),
        }),
    }
}

impl Nccl {
    fn load() -> Result<Self, NcclError> {
        let mut nccl_names: Vec<String> = Vec::new();
        if let Some(path) = std::env::var_os(LIBRARY_ENV).filter(|path| !path.is_empty()) {
            nccl_names.push(path.to_string_lossy().into_owned());
        }
        nccl_names.extend(NCCL_NAMES.iter().map(|name| name.to_string()));
        let (nccl, nccl_name) = open_first(&nccl_names)?;
        let cudart_names: Vec<String> = CUDART_NAMES.iter().map(|name| name.to_string()).collect();
        let (cudart, cudart_name) = open_first(&cudart_names)?;

        // SAFETY: each type alias above transcribes the C declaration from nccl.h or
        // cuda_runtime_api.h of the symbol it is used with.
        let (get_version, lib) = unsafe {
            let n = nccl_name.as_str();
            let c = cudart_name.as_str();
            let get_version: GetVersionFn = symbol(&nccl, n, "ncclGetVersion")?;
            let lib = Self {
                version_code: 0,
                get_unique_id: symbol(&nccl, n, "ncclGetUniqueId")?,
                comm_init_rank_config: symbol(&nccl, n, "ncclCommInitRankConfig")?,
                all_reduce: symbol(&nccl, n, "ncclAllReduce")?,
                broadcast: symbol(&nccl, n, "ncclBroadcast")?,
                comm_finalize: symbol(&nccl, n, "ncclCommFinalize")?,
                comm_destroy: symbol(&nccl, n, "ncclCommDestroy")?,
                comm_abort: symbol(&nccl, n, "ncclCommAbort")?,
                comm_get_async_error: symbol(&nccl, n, "ncclCommGetAsyncError")?,
                get_error_string: symbol(&nccl, n, "ncclGetErrorString")?,
                get_last_error: symbol(&nccl, n, "ncclGetLastError")?,
                cuda_set_device: symbol(&cudart, c, "cudaSetDevice")?,
                cuda_get_error_string: symbol(&cudart, c, "cudaGetErrorString").ok(),
                nccl_name: nccl_name.clone(),
                cudart_name: cudart_name.clone(),
                _nccl: nccl,
                _cudart: cudart,
            };
            (get_version, lib)
        };
        let mut code: c_int = 0;
        // SAFETY: `code` is a valid, writable int for the call's duration.
        let result = unsafe { get_version(&mut code) };
        lib.nccl_result("ncclGetVersion", result, None)?;
        Ok(Self {
            version_code: code,
            ..lib
        })
    }

    /// The NCCL version, such as `2.28.9`.
    pub fn version(&self) -> String {
        let code = self.version_code;
        // NCCL 2.9 and later encode major * 10000 + minor * 100 + patch; earlier ones
        // major * 1000 + minor * 100 + patch.
        let (major, minor, patch) = if code >= 10_000 {
            (code / 10_000, code % 10_000 / 100, code % 100)
        } else {
            (code / 1000, code % 1000 / 100, code % 100)
        };
        format!("{major}.{minor}.{patch}")
    }

    /// The library NCCL was loaded from (the path or soname that worked).
    pub fn library_name(&self) -> &str {
        &self.nccl_name
    }

    /// A fresh id for a new communicator: one rank makes it and sends it to the others.
    /// Needs no GPU.
    pub fn unique_id(&self) -> Result<UniqueId, NcclError> {
        let mut raw = RawUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        // SAFETY: `raw` is a valid, writable ncclUniqueId for the call's duration.
        let result = unsafe { (self.get_unique_id)(&mut raw) };
        self.nccl_result("ncclGetUniqueId", result, None)?;
        Ok(UniqueId(raw.internal))
    }

    /// `Ok` for `ncclSuccess`, otherwise [`Self::call_error`].
    fn nccl_result(
        &self,
        call: &'static str,
        code: c_int,
        comm: Option<RawComm>,
    ) -> Result<(), NcclError> {
        if code == NCCL_SUCCESS {
            return Ok(());
        }
        Err(self.call_error(call, code, comm))
    }

    /// A [`NcclError::Call`] naming `call` with NCCL's text for `code` and, given a
    /// communicator, its last error message.
    fn call_error(&self, call: &'static str, code: c_int, comm: Option<RawComm>) -> NcclError {
        let mut message = self.error_string(code);
        if let Some(comm) = comm {
            // SAFETY: `comm` is a live communicator; NCCL returns a NUL-terminated string
            // it owns (or null), copied before any other NCCL call.
            let last = unsafe { c_text((self.get_last_error)(comm)) };
            if !last.is_empty() {
                message = format!("{message} ({last})");
            }
        }
        NcclError::Call {
            call,
            code,
            message,
        }
    }

    /// NCCL's text for a result code.
    fn error_string(&self, code: c_int) -> String {
        // SAFETY: ncclGetErrorString accepts any code and returns a static NUL-terminated
        // string (or null).
        let text = unsafe { c_text((self.get_error_string)(code)) };
        if text.is_empty() {
            "unknown error".to_string()
        } else {
            text
        }
    }

    /// Makes `device` the calling thread's current CUDA device.
    fn set_device(&self, device: c_int) -> Result<(), NcclError> {
        // SAFETY: cudaSetDevice takes any int and reports a bad one as an error.
        let code = unsafe { (self.cuda_set_device)(device) };
        if code == 0 {
            return Ok(());
        }
        let message = match self.cuda_get_error_string {
            // SAFETY: cudaGetErrorString accepts any code and returns a static
            // NUL-terminated string (or null).
            Some(text) => unsafe { c_text(text(code)) },
            None => String::new(),
        };
        Err(NcclError::Cuda {
            call: "cudaSetDevice",
            code,
            message: if message.is_empty() {
                "unknown error".to_string()
            } else {
                message
            },
        })
    }
}

/// Copies a C string into a `String` (empty for null).
///
/// # Safety
/// `text` is null or points to a NUL-terminated string that stays valid during the call.
unsafe fn c_text(text: *const c_char) -> String {
    if text.is_null() {
        return String::new();
    }
    // SAFETY: non-null, and the caller guarantees it is NUL-terminated and valid.
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .trim()
        .to_string()
}

/// An `ncclUniqueId`: what the ranks of one communicator share to find each other.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId([u8; UNIQUE_ID_BYTES]);

impl UniqueId {
    /// Lower-case hex, 256 characters.
    pub fn to_hex(&self) -> String {
        use std::fmt::Write as _;
        let mut hex = String::with_capacity(2 * UNIQUE_ID_BYTES);
        for byte in self.0 {
            // Writing to a String cannot fail.
            let _ = write!(hex, "{byte:02x}");
        }
        hex
    }

    /// Parses [`UniqueId::to_hex`]'s output: exactly 256 hex digits, either case.
    pub fn from_hex(hex: &str) -> Result<Self, NcclError> {
        let hex = hex.as_bytes();
        if hex.len() != 2 * UNIQUE_ID_BYTES {
            return Err(NcclError::Id(format!(
                "{} characters, expected {}",
                hex.len(),
                2 * UNIQUE_ID_BYTES
            )));
        }
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        for (byte, pair) in bytes.iter_mut().zip(hex.chunks_exact(2)) {
            let digit = |c: u8| {
                (c as char)
                    .to_digit(16)
                    .ok_or_else(|| NcclError::Id(format!("{:?} is not a hex digit", c as char)))
            };
            *byte = (digit(pair[0])? * 16 + digit(pair[1])?) as u8;
        }
        Ok(Self(bytes))
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hex = self.to_hex();
        write!(f, "UniqueId({}…)", &hex[..16])
    }
}

/// How polling a non-blocking NCCL operation ended, short of success.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PollFailure {
    /// The state became this NCCL error code.
    Failed(c_int),
    /// Still in progress when the deadline passed, after this long; `abort` was called.
    TimedOut(Duration),
}

/// The time as [`poll_until_ready`] sees it: how long since polling began, and a short
/// pause between polls. [`WallClock`] in the bindings, a made-up one in tests.
pub(crate) trait PollClock {
    fn elapsed(&mut self) -> Duration;
    fn pause(&mut self);
}

/// The real clock: time since its creation, [`POLL_PAUSE`] sleeps.
struct WallClock(Instant);

impl PollClock for WallClock {
    fn elapsed(&mut self) -> Duration {
        self.0.elapsed()
    }

    fn pause(&mut self) {
        std::thread::sleep(POLL_PAUSE);
    }
}

/// Polls `state` (an NCCL result: `ncclSuccess`, `ncclInProgress` or an error) until it is
/// no longer `ncclInProgress`, pausing between polls; once `limit` has passed with the
/// operation still in progress, calls `abort` (once) and gives up. The state is read at
/// least once, even with a zero limit.
pub(crate) fn poll_until_ready(
    mut state: impl FnMut() -> c_int,
    abort: impl FnOnce(),
    clock: &mut impl PollClock,
    limit: Duration,
) -> Result<(), PollFailure> {
    loop {
        match state() {
            NCCL_SUCCESS => return Ok(()),
            NCCL_IN_PROGRESS => {}
            error => return Err(PollFailure::Failed(error)),
        }
        let waited = clock.elapsed();
        if waited >= limit {
            abort();
            return Err(PollFailure::TimedOut(waited));
        }
        clock.pause();
    }
}

/// One rank's NCCL communicator on one CUDA device, non-blocking (see the module doc).
pub struct Communicator {
    comm: RawComm,
    lib: &'static Nccl,
    rank: usize,
    world: usize,
    device: usize,
    /// How long a call that answers `ncclInProgress` may take to complete.
    limit: Duration,
    /// A call failed or timed out: the communicator is only good for aborting.
    broken: Cell<bool>,
}

// SAFETY: an NCCL communicator is not tied to the thread that created it; it may be used
// from another thread as long as no two threads use it at the same time. Moving the value
// moves the only handle, and without `Sync` `&Communicator` cannot be shared between
// threads.
unsafe impl Send for Communicator {}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// Checks that `rank < world` and both fit NCCL's ints.
fn check_ranks(world: usize, rank: usize) -> Result<(c_int, c_int), NcclError> {
    let invalid = || NcclError::Rank { rank, world };
    if world == 0 || rank >= world {
        return Err(invalid());
    }
    let world_c = c_int::try_from(world).map_err(|_| invalid())?;
    let rank_c = c_int::try_from(rank).map_err(|_| invalid())?;
    Ok((world_c, rank_c))
}

/// The state of `comm` (`ncclCommGetAsyncError`'s), or the error of the call itself.
///
/// # Safety
/// `comm` is a live communicator of `lib`.
unsafe fn async_state(lib: &Nccl, comm: RawComm) -> c_int {
    let mut state: c_int = NCCL_SUCCESS;
    // SAFETY: the caller guarantees `comm` is live; `state` is a valid, writable int.
    let result = unsafe { (lib.comm_get_async_error)(comm, &mut state) };
    if result == NCCL_SUCCESS {
        state
    } else {
        result
    }
}

impl Communicator {
    /// Joins the communicator `id` as `rank` of `world`, on CUDA device `device` (which
    /// becomes the calling thread's current device), waiting at most `limit` for the
    /// other ranks; then aborts it and returns [`NcclError::InitTimeout`]. The trainer's
    /// limit is the job's step timeout (`train.step_timeout_secs`), the longest any
    /// collective of the job may wait for a peer. `limit` also bounds each later call
    /// that NCCL answers with `ncclInProgress`.
    ///
    /// Collective: completes when all `world` ranks have called it with the same id.
    pub fn init(
        lib: &'static Nccl,
        id: &UniqueId,
        world: usize,
        rank: usize,
        device: usize,
        limit: Duration,
    ) -> Result<Self, NcclError> {
        let (world_c, rank_c) = check_ranks(world, rank)?;
        let device_c = c_int::try_from(device).map_err(|_| NcclError::Cuda {
            call: "cudaSetDevice",
            code: 101, // cudaErrorInvalidDevice
            message: format!("device {device} is out of range"),
        })?;
        lib.set_device(device_c)?;
        let mut comm: RawComm = std::ptr::null_mut();
        let raw = RawUniqueId { internal: id.0 };
        let mut config = RawConfig::non_blocking(lib.version_code);
        // SAFETY: `comm` is a valid, writable ncclComm_t; the id is passed by value as
        // ncclCommInitRankConfig declares; `config` is a valid ncclConfig_t (the layout
        // of the version it names) that outlives the call; the ranks were checked above.
        let result =
            unsafe { (lib.comm_init_rank_config)(&mut comm, world_c, raw, rank_c, &mut config) };
        let started = match result {
            NCCL_SUCCESS | NCCL_IN_PROGRESS if !comm.is_null() => Ok(()),
            NCCL_SUCCESS | NCCL_IN_PROGRESS => Err(NcclError::Call {
                call: "ncclCommInitRankConfig",
                code: result,
                message: "no communicator returned".to_string(),
            }),
            code => lib.nccl_result("ncclCommInitRankConfig", code, None),
        };
        let mut aborted = false;
        let polled = started.and_then(|()| {
            let abort = || {
                // SAFETY: `comm` is live; a communicator still joining after the deadline
                // is only good for aborting, and it is not used again.
                unsafe { (lib.comm_abort)(comm) };
                aborted = true;
            };
            poll_until_ready(
                // SAFETY: `comm` is the live communicator created above.
                || unsafe { async_state(lib, comm) },
                abort,
                &mut WallClock(Instant::now()),
                limit,
            )
            .map_err(|failure| match failure {
                PollFailure::Failed(code) => {
                    lib.call_error("ncclCommInitRankConfig", code, Some(comm))
                }
                PollFailure::TimedOut(waited) => NcclError::InitTimeout {
                    rank,
                    world,
                    waited,
                },
            })
        });
        if let Err(error) = polled {
            if !aborted && !comm.is_null() {
                // SAFETY: a communicator that failed while joining is only good for
                // aborting; nothing else holds it and it is not used again.
                unsafe { (lib.comm_abort)(comm) };
            }
            return Err(error);
        }
        Ok(Self {
            comm,
            lib,
            rank,
            world,
            device,
            limit,
            broken: Cell::new(false),
        })
    }

    /// Sums a float tensor over all ranks, in place. Enqueued on the legacy default CUDA
    /// stream: asynchronous to the host, ordered with libtorch's work on that stream.
    pub fn all_reduce_sum(&self, tensor: &Tensor) -> Result<(), NcclError> {
        self.in_place("ncclAllReduce", self.lib.all_reduce, tensor, NCCL_SUM)
    }

    /// Copies `root`'s tensor to every rank, in place; like [`Self::all_reduce_sum`] on the
    /// default stream.
    pub fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<(), NcclError> {
        let (_, root_c) = check_ranks(self.world, root)?;
        self.in_place("ncclBroadcast", self.lib.broadcast, tensor, root_c)
    }

    /// Runs `collective` (`call`) in place on `tensor` with `op_or_root` as its fifth
    /// argument, on the legacy default stream; an answer of `ncclInProgress` (the
    /// non-blocking communicator still enqueues it) is polled until the collective is on
    /// the stream, so later work on the stream comes after it.
    fn in_place(
        &self,
        call: &'static str,
        collective: CollectiveFn,
        tensor: &Tensor,
        op_or_root: c_int,
    ) -> Result<(), NcclError> {
        let count = self.check_tensor(tensor)?;
        let data = tensor.data_ptr();
        // SAFETY: `collective` is ncclAllReduce or ncclBroadcast (their C declarations
        // share this shape), and `op_or_root` is a valid op or a checked rank. `data` is
        // the start of `count` contiguous f32 values on this communicator's device
        // (checked), alive while the stream uses them because libtorch's caching
        // allocator orders frees on the default stream; send and receive buffers may be
        // the same (in place); the null stream is the legacy default stream.
        let result = unsafe {
            collective(
                data,
                data,
                count,
                NCCL_FLOAT32,
                op_or_root,
                self.comm,
                std::ptr::null_mut(),
            )
        };
        self.complete(call, result)
    }

    /// Waits for a call that answered `result` to complete (see [`Self::init`]'s limit).
    fn complete(&self, call: &'static str, result: c_int) -> Result<(), NcclError> {
        let result = if result == NCCL_IN_PROGRESS {
            let polled = poll_until_ready(
                // SAFETY: `self.comm` is live.
                || unsafe { async_state(self.lib, self.comm) },
                || self.broken.set(true),
                &mut WallClock(Instant::now()),
                self.limit,
            );
            match polled {
                Ok(()) => NCCL_SUCCESS,
                Err(PollFailure::Failed(code)) => code,
                Err(PollFailure::TimedOut(waited)) => {
                    return Err(NcclError::CallTimeout { call, waited });
                }
            }
        } else {
            result
        };
        if result != NCCL_SUCCESS {
            self.broken.set(true);
        }
        self.lib.nccl_result(call, result, Some(self.comm))
    }

    /// The communicator's asynchronous error, if any (a peer died, a network failure).
    pub fn check(&self) -> Result<(), NcclError> {
        // SAFETY: `self.comm` is live.
        let state = unsafe { async_state(self.lib, self.comm) };
        if state == NCCL_IN_PROGRESS {
            return Ok(());
        }
        self.lib
            .nccl_result("ncclCommGetAsyncError", state, Some(self.comm))
    }

    pub fn device(&self) -> usize {
        self.device
    }

    /// Checks that `tensor` is a defined, contiguous float tensor on this communicator's
    /// device; returns its element count.
    fn check_tensor(&self, tensor: &Tensor) -> Result<usize, NcclError> {
        if !tensor.defined() {
            return Err(NcclError::Tensor("undefined tensor".to_string()));
        }
        match tensor.device() {
            Device::Cuda(index) if index == self.device => {}
            other => {
                return Err(NcclError::Tensor(format!(
                    "on {other:?}, expected Cuda({})",
                    self.device
                )));
            }
        }
        let kind = tensor
            .f_kind()
            .map_err(|error| NcclError::Tensor(error.to_string()))?;
        if kind != Kind::Float {
            return Err(NcclError::Tensor(format!("{kind:?}, expected Float")));
        }
        if !tensor.is_contiguous() {
            return Err(NcclError::Tensor("not contiguous".to_string()));
        }
        Ok(tensor.numel())
    }
}

impl Drop for Communicator {
    /// A healthy communicator is finalized (polled to completion, as a non-blocking one
    /// must be, within the limit) and destroyed; a broken one, or one whose finalize
    /// fails or stalls, is aborted (ncclCommDestroy can hang after a failure).
    fn drop(&mut self) {
        let healthy = !self.broken.get() && self.check().is_ok();
        let finalized = healthy && {
            // SAFETY: `self.comm` is live and used by nothing else.
            let result = unsafe { (self.lib.comm_finalize)(self.comm) };
            self.complete("ncclCommFinalize", result).is_ok()
        };
        // SAFETY: `self.comm` is live and used by nothing else; it is not used again.
        unsafe {
            if finalized {
                (self.lib.comm_destroy)(self.comm);
            } else {
                (self.lib.comm_abort)(self.comm);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How long the tests' communicators may take to start.
    const TEST_LIMIT: Duration = Duration::from_secs(60);

    /// A made-up clock: each pause moves it on by `step`.
    struct StepClock {
        now: Duration,
        step: Duration,
        pauses: usize,
    }

    impl PollClock for StepClock {
        fn elapsed(&mut self) -> Duration {
            self.now
        }

        fn pause(&mut self) {
            self.now += self.step;
            self.pauses += 1;
        }
    }

    #[test]
    fn polling_ends_ready_failed_or_aborted_at_the_deadline() {
        let second = Duration::from_secs(1);
        // (states NCCL answers in turn (the last repeats), limit, expected result,
        // states read, pauses)
        type Case = (
            &'static [c_int],
            Duration,
            Result<(), PollFailure>,
            usize,
            usize,
        );
        let cases: [Case; 6] = [
            (&[NCCL_SUCCESS], 10 * second, Ok(()), 1, 0),
            (&[NCCL_SUCCESS], Duration::ZERO, Ok(()), 1, 0),
            (
                &[
                    NCCL_IN_PROGRESS,
                    NCCL_IN_PROGRESS,
                    NCCL_IN_PROGRESS,
                    NCCL_SUCCESS,
                ],
                10 * second,
                Ok(()),
                4,
                3,
            ),
            (
                &[NCCL_IN_PROGRESS, 2],
                10 * second,
                Err(PollFailure::Failed(2)),
                2,
                1,
            ),
            (
                &[NCCL_IN_PROGRESS],
                3 * second,
                Err(PollFailure::TimedOut(3 * second)),
                4,
                3,
            ),
            (
                &[NCCL_IN_PROGRESS],
                Duration::ZERO,
                Err(PollFailure::TimedOut(Duration::ZERO)),
                1,
                0,
            ),
        ];
        for (i, (states, limit, want, reads, pauses)) in cases.into_iter().enumerate() {
            let mut clock = StepClock {
                now: Duration::ZERO,
                step: second,
                pauses: 0,
            };
            let mut read = 0;
            let mut aborts = 0;
            let got = poll_until_ready(
                || {
                    read += 1;
                    states[(read - 1).min(states.len() - 1)]
                },
                || aborts += 1,
                &mut clock,
                limit,
            );
            assert_eq!(got, want, "case {i}");
            assert_eq!((read, clock.pauses), (reads, pauses), "case {i}");
            let timed_out = matches!(want, Err(PollFailure::TimedOut(_)));
            assert_eq!(aborts, usize::from(timed_out), "case {i}: aborts");
        }
    }

    /// Offsets and size of `ncclConfig_t` measured from NCCL 2.28.9's nccl.h (the
    /// `nvidia-nccl` wheel of torch 2.11) with offsetof and sizeof on x86-64 Linux.
    #[test]
    fn config_has_the_layout_of_nccl_2_28_9() {
        assert_eq!(std::mem::size_of::<RawConfig>(), 80);
        assert_eq!(std::mem::offset_of!(RawConfig, blocking), 16);
        assert_eq!(std::mem::offset_of!(RawConfig, net_name), 32);
        assert_eq!(std::mem::offset_of!(RawConfig, split_share), 40);
        assert_eq!(std::mem::offset_of!(RawConfig, comm_name), 48);
        assert_eq!(std::mem::offset_of!(RawConfig, collnet_enable), 56);
        assert_eq!(std::mem::offset_of!(RawConfig, nvlink_centric_sched), 76);
        let config = RawConfig::non_blocking(22809);
        assert_eq!(
            (config.size, config.magic, config.version),
            (80, 0xcafebeef, 22809)
        );
        assert_eq!((config.blocking, config.min_ctas), (0, i32::MIN));
        assert!(config.net_name.is_null() && config.comm_name.is_null());
        // An older library is told the config is of its version; a newer one, of ours.
        assert_eq!(RawConfig::non_blocking(22105).version, 22105);
        assert_eq!(RawConfig::non_blocking(23001).version, 22809);
    }

    #[test]
    fn init_timeout_says_what_to_check() {
        let error = NcclError::InitTimeout {
            rank: 1,
            world: 4,
            waited: Duration::from_secs(600),
        };
        let text = error.to_string();
        for want in [
            "rank 1 of 4",
            "600s",
            "NCCL_SOCKET_IFNAME",
            "firewall",
            "started",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
    }

    #[test]
    fn unique_id_hex_round_trips_and_rejects_bad_input() {
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = (i * 37 + 11) as u8;
        }
        let id = UniqueId(bytes);
        let hex = id.to_hex();
        assert_eq!(hex.len(), 256);
        assert!(hex.starts_with("0b30"), "{hex}");
        assert_eq!(UniqueId::from_hex(&hex).ok(), Some(id.clone()));
        assert_eq!(
            UniqueId::from_hex(&hex.to_uppercase()).ok(),
            Some(id.clone())
        );
        let debug = format!("{id:?}");
        assert!(debug.len() < 40, "{debug}");

        for bad in [
            String::new(),
            hex[..254].to_string(),
            format!("{hex}00"),
            format!("{}zz", &hex[..254]),
            format!("{}é", &hex[..254]),
            format!("+{}", &hex[..255]),
        ] {
            match UniqueId::from_hex(&bad) {
                Err(NcclError::Id(message)) => assert!(!message.is_empty()),
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
    }

    /// Whether libtorch was built with CUDA. `has_cuda` also needs a GPU (CUDA's hooks
    /// answer it with the device count); `has_cudart` is true for any CUDA build.
    fn built_with_cuda() -> bool {
        let (cuda, cudart) = (tch::utils::has_cuda(), tch::utils::has_cudart());
        println!("has_cuda {cuda}, has_cudart {cudart}");
        cuda || cudart
    }

    #[test]
    fn library_loads_and_makes_distinct_ids() {
        if !built_with_cuda()
            && let Err(error) = library()
        {
            assert!(error.to_string().contains("libnccl"), "{error}");
            return;
        }
        let lib = match library() {
            Ok(lib) => lib,
            Err(error) => panic!("libtorch has CUDA but NCCL does not load: {error}"),
        };
        let version = lib.version();
        println!("NCCL {version} from {} ({lib:?})", lib.library_name());
        assert!(version.starts_with("2."), "{version}");
        let minor: u32 = match version.split('.').nth(1).map(str::parse) {
            Some(Ok(minor)) => minor,
            other => panic!("version {version}: minor {other:?}"),
        };
        assert!(minor >= 18, "{version}");

        let first = lib.unique_id().expect("ncclGetUniqueId");
        let second = lib.unique_id().expect("ncclGetUniqueId");
        println!("ids {first:?} {second:?}");
        assert!(first.to_hex().bytes().any(|b| b != b'0'));
        assert!(second.to_hex().bytes().any(|b| b != b'0'));
        assert_ne!(first, second);
    }

    #[test]
    fn init_rejects_bad_ranks_before_cuda() {
        assert!(check_ranks(1, 0).is_ok());
        assert!(check_ranks(4, 3).is_ok());
        for (world, rank) in [(0, 0), (1, 1), (2, 5), (usize::MAX, 0)] {
            match check_ranks(world, rank) {
                Err(NcclError::Rank { .. }) => {}
                other => panic!("world {world} rank {rank} gave {other:?}"),
            }
        }
        let Ok(lib) = library() else { return };
        let id = UniqueId([0; UNIQUE_ID_BYTES]);
        for (world, rank) in [(2, 2), (0, 0)] {
            match Communicator::init(lib, &id, world, rank, 0, TEST_LIMIT) {
                Err(NcclError::Rank { rank: r, world: w }) => {
                    assert_eq!((r, w), (rank, world));
                }
                other => panic!("world {world} rank {rank} gave {other:?}"),
            }
        }
    }

    #[test]
    fn world_of_one_communicator() {
        if !built_with_cuda() {
            return;
        }
        let lib = match library() {
            Ok(lib) => lib,
            Err(error) => panic!("libtorch has CUDA but NCCL does not load: {error}"),
        };
        let id = lib.unique_id().expect("ncclGetUniqueId");
        if !tch::Cuda::is_available() {
            match Communicator::init(lib, &id, 1, 0, 0, TEST_LIMIT) {
                Ok(comm) => panic!("{comm:?} without a GPU"),
                Err(error) => {
                    let text = error.to_string();
                    println!("without a GPU: {text}");
                    assert!(
                        text.starts_with("cudaSetDevice ")
                            || text.starts_with("ncclCommInitRankConfig "),
                        "{text}"
                    );
                }
            }
            return;
        }

        let comm = Communicator::init(lib, &id, 1, 0, 0, TEST_LIMIT).expect("world of one");
        assert_eq!(comm.device(), 0);
        let expected = Tensor::arange(10, (Kind::Float, Device::Cpu));
        let tensor = Tensor::arange(10, (Kind::Float, Device::Cuda(0)));
        comm.all_reduce_sum(&tensor).expect("all_reduce_sum");
        assert!(tensor.to_device(Device::Cpu).equal(&expected));
        comm.broadcast(&tensor, 0).expect("broadcast");
        assert!(tensor.to_device(Device::Cpu).equal(&expected));
        comm.check().expect("check");

        match comm.all_reduce_sum(&expected) {
            Err(NcclError::Tensor(_)) => {}
            other => panic!("a CPU tensor gave {other:?}"),
        }
        let doubles = Tensor::arange(10, (Kind::Double, Device::Cuda(0)));
        match comm.all_reduce_sum(&doubles) {
            Err(NcclError::Tensor(_)) => {}
            other => panic!("a double tensor gave {other:?}"),
        }
        let strided = Tensor::zeros([4, 4], (Kind::Float, Device::Cuda(0))).tr();
        match comm.all_reduce_sum(&strided) {
            Err(NcclError::Tensor(_)) => {}
            other => panic!("a transposed tensor gave {other:?}"),
        }
        match comm.broadcast(&tensor, 1) {
            Err(NcclError::Rank { .. }) => {}
            other => panic!("root 1 of 1 gave {other:?}"),
        }
    }
}
