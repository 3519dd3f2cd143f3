//! Minimal NCCL bindings for averaging gradients between CUDA trainers: the NCCL and CUDA
//! runtime libraries that libtorch_cuda already loaded, found by soname at run time.
//!
//! libtorch_cuda.so has `NEEDED libnccl.so.2` and `libcudart.so.13` (with an rpath to the
//! wheel's `nvidia/*/lib` folders) and our binaries link it with `--no-as-needed`, so
//! `dlopen("libnccl.so.2")` returns the copy that is already in the process. Only the calls
//! a data-parallel trainer needs are bound: unique ids, communicator set-up and tear-down,
//! in-place float sum allreduce and broadcast on the legacy default stream (the stream
//! libtorch uses by default), and the asynchronous error check.

// FFI into NCCL and the CUDA runtime cannot be done without unsafe code; every block says
// why it is sound.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_void};
use std::fmt;
use std::sync::OnceLock;

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

/// `ncclComm_t`.
type RawComm = *mut c_void;
/// `cudaStream_t`.
type RawStream = *mut c_void;

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueIdFn = unsafe extern "C" fn(*mut RawUniqueId) -> c_int;
type CommInitRankFn = unsafe extern "C" fn(*mut RawComm, c_int, RawUniqueId, c_int) -> c_int;
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
    comm_init_rank: CommInitRankFn,
    all_reduce: CollectiveFn,
    broadcast: CollectiveFn,
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
                comm_init_rank: symbol(&nccl, n, "ncclCommInitRank")?,
                all_reduce: symbol(&nccl, n, "ncclAllReduce")?,
                broadcast: symbol(&nccl, n, "ncclBroadcast")?,
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

    /// `Ok` for `ncclSuccess`, otherwise a [`NcclError::Call`] naming `call` with NCCL's
    /// text for `code` and, given a communicator, its last error message.
    fn nccl_result(
        &self,
        call: &'static str,
        code: c_int,
        comm: Option<RawComm>,
    ) -> Result<(), NcclError> {
        if code == NCCL_SUCCESS {
            return Ok(());
        }
        let mut message = self.error_string(code);
        if let Some(comm) = comm {
            // SAFETY: `comm` is a live communicator; NCCL returns a NUL-terminated string
            // it owns (or null), copied before any other NCCL call.
            let last = unsafe { c_text((self.get_last_error)(comm)) };
            if !last.is_empty() {
                message = format!("{message} ({last})");
            }
        }
        Err(NcclError::Call {
            call,
            code,
            message,
        })
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

/// One rank's NCCL communicator on one CUDA device.
pub struct Communicator {
    comm: RawComm,
    lib: &'static Nccl,
    rank: usize,
    world: usize,
    device: usize,
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

impl Communicator {
    /// Joins the communicator `id` as `rank` of `world`, on CUDA device `device` (which
    /// becomes the calling thread's current device).
    ///
    /// Collective: blocks until all `world` ranks have called it with the same id.
    pub fn init(
        lib: &'static Nccl,
        id: &UniqueId,
        world: usize,
        rank: usize,
        device: usize,
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
        // SAFETY: `comm` is a valid, writable ncclComm_t; the id is passed by value as
        // ncclCommInitRank declares; the ranks were checked above.
        let result = unsafe { (lib.comm_init_rank)(&mut comm, world_c, raw, rank_c) };
        if result != NCCL_SUCCESS {
            let error = lib.nccl_result("ncclCommInitRank", result, None);
            if !comm.is_null() {
                // SAFETY: a communicator NCCL handed back from a failed init is only
                // good for freeing; nothing else holds it.
                unsafe { (lib.comm_abort)(comm) };
            }
            error?;
        }
        if comm.is_null() {
            return Err(NcclError::Call {
                call: "ncclCommInitRank",
                code: NCCL_SUCCESS,
                message: "no communicator returned".to_string(),
            });
        }
        Ok(Self {
            comm,
            lib,
            rank,
            world,
            device,
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
    /// argument, on the legacy default stream.
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
        self.lib.nccl_result(call, result, Some(self.comm))
    }

    /// The communicator's asynchronous error, if any (a peer died, a network failure).
    pub fn check(&self) -> Result<(), NcclError> {
        let mut state: c_int = NCCL_SUCCESS;
        // SAFETY: `self.comm` is live; `state` is a valid, writable int.
        let result = unsafe { (self.lib.comm_get_async_error)(self.comm, &mut state) };
        self.lib
            .nccl_result("ncclCommGetAsyncError", result, Some(self.comm))?;
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
    fn drop(&mut self) {
        // ncclCommDestroy can hang after a failure; abort then.
        let failed = self.check().is_err();
        // SAFETY: `self.comm` is live and used by nothing else; it is not used again.
        unsafe {
            if failed {
                (self.lib.comm_abort)(self.comm);
            } else {
                (self.lib.comm_destroy)(self.comm);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            match Communicator::init(lib, &id, world, rank, 0) {
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
            match Communicator::init(lib, &id, 1, 0, 0) {
                Ok(comm) => panic!("{comm:?} without a GPU"),
                Err(error) => {
                    let text = error.to_string();
                    println!("without a GPU: {text}");
                    assert!(
                        text.starts_with("cudaSetDevice ") || text.starts_with("ncclCommInitRank "),
                        "{text}"
                    );
                }
            }
            return;
        }

        let comm = Communicator::init(lib, &id, 1, 0, 0).expect("world of one");
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
