//! `s3://` shards: AWS S3 and the stores that speak its API (MinIO, Ceph, AIStore,
//! Cloudflare R2, GCS's XML API with HMAC keys), read through the `object_store` crate;
//! and `az://container/key`, Azure Blob Storage, through the same crate and the same
//! reader and writer (its account and keys from Azure's own environment variables).
//!
//! A shard is read as ranged GETs of `chunk_bytes`, `chunks_in_flight` of them ahead of
//! the tar reader and at most `max_requests` at once in the process, handed to the reader
//! in order: the bytes, and so the samples, are those of one plain GET. Every range names
//! the ETag the object had when the shard was opened (`If-Match`), so an object replaced
//! mid-read fails its shard with [`ObjectProblem::Changed`] rather than mixing two
//! versions. object_store retries a request that fails (5xx, 503 Slow Down, a reset) with
//! backoff, and resumes a body that breaks off or stalls (no end within
//! `request_timeout`) at its byte offset under the same ETag: `attempts` tries in all.
//! What still fails is told apart by the last status the store answered (missing,
//! denied, throttled), with bucket and key in the message.
//!
//! Credentials are found as the AWS tools find them: `AWS_ACCESS_KEY_ID` and
//! `AWS_SECRET_ACCESS_KEY` (with `AWS_SESSION_TOKEN`), else the profile's keys in the
//! shared credentials and config files, else what object_store finds itself (a web
//! identity token, a container's or an instance's role). They are never logged: no
//! `Debug` here shows them, and no message holds them.
//!
//! The sources are synchronous and the store is not: one small runtime per process runs
//! every request, and a reader waits on a channel for its next range.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::io::{self, Read, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex, OnceLock, mpsc};

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpRequest, HttpResponse, HttpService, ReqwestConnector,
};
use object_store::path::Path as ObjectPath;
use object_store::{
    BackoffConfig, ClientOptions, Extensions, GetOptions, GetRange, MultipartUpload, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, RetryConfig,
};
use tokio::sync::Semaphore;

use crate::error::{ObjectProblem, ShardError, one_line};
use crate::stream::{S3Options, ShardSource, ShardStream, SourceKind, SourceOptions};

/// Threads of the process's request runtime: requests wait on the network, not the CPU.
const RUNTIME_THREADS: usize = 2;

/// The object stores whose URLs are read and written here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Scheme {
    /// `s3://bucket/key`: AWS S3 and the stores that speak its API (Google Cloud
    /// Storage among them, through its XML API with HMAC keys).
    S3,
    /// `az://container/key`: Azure Blob Storage.
    Az,
}

impl Scheme {
    const ALL: [Scheme; 2] = [Scheme::S3, Scheme::Az];

    fn prefix(self) -> &'static str {
        match self {
            Scheme::S3 => "s3://",
            Scheme::Az => "az://",
        }
    }

    fn of(url: &str) -> Option<Scheme> {
        Self::ALL.into_iter().find(|s| url.starts_with(s.prefix()))
    }
}

/// Whether `url` names an object in a store (`s3://` or `az://`).
pub fn is_object_url(url: &str) -> bool {
    Scheme::of(url).is_some()
}

/// The store, bucket (an Azure container) and key of an object's URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ObjectUrl {
    pub scheme: Scheme,
    pub bucket: String,
    pub key: String,
}

impl ObjectUrl {
    pub(crate) fn parse(url: &str) -> Result<Self, ShardError> {
        let bad = |reason: &str| ShardError::BadUrl {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let scheme = Scheme::of(url).ok_or_else(|| bad("not an s3:// or az:// URL"))?;
        let rest = &url[scheme.prefix().len()..];
        let (bucket, key) = rest
            .split_once('/')
            .ok_or_else(|| bad("no key after the bucket (SCHEME://BUCKET/KEY)"))?;
        if bucket.is_empty() {
            return Err(bad("no bucket (SCHEME://BUCKET/KEY)"));
        }
        if key.is_empty() {
            return Err(bad("no key after the bucket (SCHEME://BUCKET/KEY)"));
        }
        Ok(Self {
            scheme,
            bucket: bucket.to_string(),
            key: key.to_string(),
        })
    }

    /// The URL of `key` in the same bucket.
    fn with_key(&self, key: &str) -> String {
        format!("{}{}/{key}", self.scheme.prefix(), self.bucket)
    }
}

/// An object's failure carried through `io::Error` by a reader, recovered as a
/// [`ShardError::Object`] (see `source::source_failure`).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{url}: {problem} (bucket `{bucket}`, key `{key}`)")]
pub(crate) struct ObjectFailure {
    url: String,
    bucket: String,
    key: String,
    problem: ObjectProblem,
}

impl ObjectFailure {
    pub(crate) fn to_shard_error(&self) -> ShardError {
        ShardError::Object {
            url: self.url.clone(),
            bucket: self.bucket.clone(),
            key: self.key.clone(),
            problem: self.problem.clone(),
        }
    }
}

impl ObjectUrl {
    /// The key as an object path; `url` names it in the error.
    fn path(&self, url: &str) -> Result<ObjectPath, ShardError> {
        ObjectPath::parse(&self.key).map_err(|error| ShardError::BadUrl {
            url: url.to_string(),
            reason: format!("the key is not a valid object path: {error}"),
        })
    }
}

/// The process's client of `location`'s bucket with `options`, made on first use: its
/// connections are reused by every reader and writer. `url` names the bucket in an error.
fn client(
    options: &S3Options,
    url: &str,
    location: &ObjectUrl,
) -> Result<Arc<dyn ObjectStore>, ShardError> {
    type Clients = HashMap<(S3Options, Scheme, String), Arc<dyn ObjectStore>>;
    let bucket = location.bucket.as_str();
    static CLIENTS: OnceLock<Mutex<Clients>> = OnceLock::new();
    let mut clients = CLIENTS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let key = (options.clone(), location.scheme, bucket.to_string());
    if let Some(store) = clients.get(&key) {
        return Ok(Arc::clone(store));
    }
    let bad = |reason: String| ShardError::BadUrl {
        url: url.to_string(),
        reason,
    };
    let cannot = |error: object_store::Error| {
        bad(format!(
            "cannot make a client for bucket `{bucket}`: {}",
            one_line(&error)
        ))
    };
    // Azure's settings come from its usual environment variables, which its builder reads
    // itself: AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, a SAS token or a
    // service principal's; AZURE_STORAGE_USE_EMULATOR (Azurite, at
    // AZURITE_BLOB_STORAGE_URL) for plain HTTP.
    let store: Arc<dyn ObjectStore> = match location.scheme {
        Scheme::S3 => {
            let settings = Settings::resolve(options, &|name| std::env::var(name).ok(), &|path| {
                std::fs::read_to_string(path).ok()
            })
            .map_err(bad)?;
            Arc::new(settings.builder(bucket, options).build().map_err(cannot)?)
        }
        Scheme::Az => Arc::new(
            MicrosoftAzureBuilder::from_env()
                .with_container_name(bucket)
                .with_client_options(client_options(options, false))
                .with_retry(retry_config(options))
                .with_http_connector(ObservingConnector)
                .build()
                .map_err(cannot)?,
        ),
    };
    clients.insert(key, Arc::clone(&store));
    Ok(store)
}

/// Reads `s3://` shards through the process's clients ([`client`]).
pub(crate) struct S3Source {
    options: S3Options,
}

impl fmt::Debug for S3Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Source")
            .field("endpoint", &self.options.endpoint)
            .field("region", &self.options.region)
            .finish_non_exhaustive()
    }
}

impl S3Source {
    pub(crate) fn new(options: &SourceOptions) -> Self {
        Self {
            options: options.s3.clone(),
        }
    }

    /// The object of `url`, found with a HEAD request: its size and ETag.
    fn object(&self, url: &str) -> Result<Object, ShardError> {
        let location = ObjectUrl::parse(url)?;
        let store = client(&self.options, url, &location)?;
        let path = location.path(url)?;
        let last = LastStatus::default();
        let options = GetOptions {
            head: true,
            extensions: last.extensions(),
            ..GetOptions::default()
        };
        let (head_store, head_path) = (Arc::clone(&store), path.clone());
        let head = wait(&self.options, async move {
            head_store.get_opts(&head_path, options).await
        });
        let meta = match head {
            Ok(result) => result.meta,
            Err(error) => {
                let problem = problem_of(&error, &last, self.options.attempts, None);
                return Err(failure(url, &location, problem).to_shard_error());
            }
        };
        Ok(Object {
            url: url.to_string(),
            location,
            store,
            path,
            size: meta.size,
            etag: meta.e_tag,
            attempts: self.options.attempts,
        })
    }

    /// The `s3://` URLs of the objects that `pattern` matches, in key order: `*` and `?`
    /// in its key's last part (`s3://bucket/train/shard-*.tar`), listed under the part
    /// before the first of them.
    pub(crate) fn list(&self, pattern: &str) -> Result<Vec<String>, ShardError> {
        let location = ObjectUrl::parse(pattern)?;
        let store = client(&self.options, pattern, &location)?;
        let prefix = list_prefix(&location.key);
        let last = LastStatus::default();
        let listing = Arc::clone(&store);
        let folder = prefix
            .rsplit_once('/')
            .map(|(folder, _)| folder.to_string());
        let listed = wait(&self.options, async move {
            let prefix = folder.map(ObjectPath::from);
            listing.list(prefix.as_ref()).try_collect::<Vec<_>>().await
        });
        let objects = listed.map_err(|error| {
            let problem = problem_of(&error, &last, self.options.attempts, None);
            failure(pattern, &location, problem).to_shard_error()
        })?;
        let mut urls: Vec<String> = objects
            .into_iter()
            .map(|meta| meta.location.to_string())
            .filter(|key| glob_match(&location.key, key))
            .map(|key| location.with_key(&key))
            .collect();
        urls.sort();
        Ok(urls)
    }
}

impl ShardSource for S3Source {
    fn kind(&self) -> SourceKind {
        SourceKind::S3
    }

    fn handles(&self, url: &str) -> bool {
        is_object_url(url)
    }

    fn open(&self, url: &str) -> Result<ShardStream, ShardError> {
        self.open_sized(url).map(|(stream, _)| stream)
    }

    fn open_sized(&self, url: &str) -> Result<(ShardStream, Option<u64>), ShardError> {
        let object = Arc::new(self.object(url)?);
        let size = object.size;
        let reader = RangedReader::new(object, &self.options);
        Ok((Box::new(reader), Some(size)))
    }
}

/// Whether `url` names objects by a pattern to be listed (`*` or `?` in its key).
pub(crate) fn is_pattern(url: &str) -> bool {
    Scheme::of(url)
        .and_then(|scheme| url[scheme.prefix().len()..].split_once('/'))
        .is_some_and(|(_, key)| key.contains(['*', '?']))
}

/// The part of a key pattern before its first wildcard.
fn list_prefix(pattern: &str) -> &str {
    let end = pattern.find(['*', '?']).unwrap_or(pattern.len());
    &pattern[..end]
}

/// Whether `key` matches `pattern`: `*` is any run of characters but `/`, `?` one
/// character but `/`; everything else stands for itself.
fn glob_match(pattern: &str, key: &str) -> bool {
    let (pattern, key): (Vec<char>, Vec<char>) = (pattern.chars().collect(), key.chars().collect());
    // The classic two-pointer match, with the last `*` to fall back to.
    let (mut p, mut k) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while k < key.len() {
        match pattern.get(p) {
            Some('*') => {
                star = Some((p, k));
                p += 1;
            }
            Some('?') if key[k] != '/' => {
                p += 1;
                k += 1;
            }
            Some(c) if *c != '?' && *c == key[k] => {
                p += 1;
                k += 1;
            }
            _ => match star {
                Some((star_p, star_k)) if key[star_k] != '/' => {
                    star = Some((star_p, star_k + 1));
                    p = star_p + 1;
                    k = star_k + 1;
                }
                _ => return false,
            },
        }
    }
    pattern[p..].iter().all(|c| *c == '*')
}

/// What a process's `s3://` reads share: the runtime that runs every request, and the
/// cap on requests in flight.
struct Shared {
    runtime: tokio::runtime::Runtime,
    requests: Arc<Semaphore>,
}

/// The process's [`Shared`], made on first use with that use's cap.
fn shared(options: &S3Options) -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| Shared {
        runtime: tokio::runtime::Builder::new_multi_thread()
            .worker_threads(RUNTIME_THREADS)
            .thread_name("imgrun-s3")
            .enable_all()
            .build()
            .unwrap_or_else(|error| panic!("cannot start the s3 request runtime: {error}")),
        requests: Arc::new(Semaphore::new(options.max_requests.max(1))),
    })
}

/// Runs `future` on the process's runtime and waits for its output, from any thread (a
/// runtime's too: the wait is on a plain channel). `None` if the runtime dropped it.
fn run<T: Send + 'static>(
    options: &S3Options,
    future: impl Future<Output = T> + Send + 'static,
) -> Option<T> {
    let (send, receive) = mpsc::sync_channel(1);
    shared(options).runtime.spawn(async move {
        let _ = send.send(future.await);
    });
    receive.recv().ok()
}

/// [`run`] for a request: the runtime dropping it is an error too.
fn wait<T: Send + 'static>(
    options: &S3Options,
    future: impl Future<Output = Result<T, object_store::Error>> + Send + 'static,
) -> Result<T, object_store::Error> {
    run(options, future).unwrap_or_else(|| Err(dropped()))
}

fn dropped() -> object_store::Error {
    object_store::Error::Generic {
        store: "S3",
        source: "the request runtime dropped the request".into(),
    }
}

/// An [`ObjectFailure`] of the object at `location`, read as `url`.
fn failure(url: &str, location: &ObjectUrl, problem: ObjectProblem) -> ObjectFailure {
    ObjectFailure {
        url: url.to_string(),
        bucket: location.bucket.clone(),
        key: location.key.clone(),
        problem,
    }
}

/// One object being read: where it is, and what HEAD said of it.
struct Object {
    url: String,
    location: ObjectUrl,
    store: Arc<dyn ObjectStore>,
    path: ObjectPath,
    size: u64,
    /// `None` where the store gives none; its ranges then go unchecked.
    etag: Option<String>,
    attempts: u32,
}

impl Object {
    /// Fetches `range` of the object, as one request (retried and resumed inside
    /// object_store), under the cap on requests in flight.
    async fn fetch(
        self: Arc<Self>,
        range: Range<u64>,
        requests: Arc<Semaphore>,
    ) -> Result<Bytes, ObjectFailure> {
        let _permit = requests.acquire_owned().await.map_err(|_| {
            self.failure(ObjectProblem::Failed {
                reason: "the request runtime is shutting down".to_string(),
            })
        })?;
        let last = LastStatus::default();
        let options = GetOptions {
            if_match: self.etag.clone(),
            range: Some(GetRange::Bounded(range.clone())),
            extensions: last.extensions(),
            ..GetOptions::default()
        };
        let fetched = match self.store.get_opts(&self.path, options).await {
            Ok(result) => result.bytes().await,
            Err(error) => Err(error),
        };
        let bytes = fetched.map_err(|error| {
            self.failure(problem_of(
                &error,
                &last,
                self.attempts,
                self.etag.as_deref(),
            ))
        })?;
        let want = range.end - range.start;
        if bytes.len() as u64 != want {
            return Err(self.failure(ObjectProblem::Failed {
                reason: format!(
                    "the {want} bytes at offset {} came back as {} bytes",
                    range.start,
                    bytes.len()
                ),
            }));
        }
        Ok(bytes)
    }

    fn failure(&self, problem: ObjectProblem) -> ObjectFailure {
        failure(&self.url, &self.location, problem)
    }
}

/// A range requested ahead of the reader: its answer comes on `answer`.
struct Pending {
    answer: mpsc::Receiver<Result<Bytes, ObjectFailure>>,
    task: tokio::task::JoinHandle<()>,
}

/// An object's bytes in order, from ranged GETs requested ahead. A failure sticks: once
/// a range failed, every later read reports it again instead of an early end.
struct RangedReader {
    object: Arc<Object>,
    chunk: u64,
    ahead: usize,
    requests: Arc<Semaphore>,
    runtime: tokio::runtime::Handle,
    /// Where the next range to request starts.
    next: u64,
    pending: VecDeque<Pending>,
    /// What is left of the range being read.
    current: Bytes,
    failure: Option<ObjectFailure>,
}

impl RangedReader {
    fn new(object: Arc<Object>, options: &S3Options) -> Self {
        let shared = shared(options);
        let mut reader = Self {
            object,
            chunk: options.chunk_bytes.max(1),
            ahead: options.chunks_in_flight.max(1),
            requests: Arc::clone(&shared.requests),
            runtime: shared.runtime.handle().clone(),
            next: 0,
            pending: VecDeque::new(),
            current: Bytes::new(),
            failure: None,
        };
        reader.request_ahead();
        reader
    }

    /// Requests ranges until `ahead` are pending or the object is all requested.
    fn request_ahead(&mut self) {
        while self.pending.len() < self.ahead && self.next < self.object.size {
            let end = (self.next + self.chunk).min(self.object.size);
            let (send, answer) = mpsc::sync_channel(1);
            let fetch = Arc::clone(&self.object).fetch(self.next..end, Arc::clone(&self.requests));
            let task = self.runtime.spawn(async move {
                let _ = send.send(fetch.await);
            });
            self.pending.push_back(Pending { answer, task });
            self.next = end;
        }
    }
}

impl Read for RangedReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            if let Some(failure) = &self.failure {
                return Err(io::Error::other(failure.clone()));
            }
            let Some(pending) = self.pending.pop_front() else {
                return Ok(0);
            };
            let answer = pending.answer.recv().unwrap_or_else(|_| {
                Err(self.object.failure(ObjectProblem::Failed {
                    reason: "a range request ended without an answer".to_string(),
                }))
            });
            match answer {
                Ok(bytes) => self.current = bytes,
                Err(failure) => self.failure = Some(failure),
            }
            self.request_ahead();
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

impl Drop for RangedReader {
    /// A shard left early (a skipped shard, a stopped epoch) cancels what it requested.
    fn drop(&mut self) {
        for pending in &self.pending {
            pending.task.abort();
        }
    }
}

/// Smallest part of a multipart upload that S3 takes (all but the last part).
const MIN_PART: u64 = 5 << 20;

/// Parts of one upload sent ahead of the writer.
const PARTS_IN_FLIGHT: usize = 4;

/// An object being written: its bytes go up in parts of `s3.chunk_size` (at least 5 MiB)
/// as they come, through a multipart upload, and the object appears under its key only
/// when [`finish`](Self::finish) completes the upload; an object smaller than one part
/// goes up in one PUT at the end. Dropped unfinished (an error, a cancelled command), the
/// upload is aborted: nothing is ever half-visible under the key, and no parts are left
/// to pay for.
pub struct ObjectWriter {
    url: String,
    location: ObjectUrl,
    store: Arc<dyn ObjectStore>,
    path: ObjectPath,
    options: S3Options,
    part_bytes: usize,
    buffer: Vec<u8>,
    upload: Option<Box<dyn MultipartUpload>>,
    /// Parts sent, oldest first, with their answers to come.
    parts: VecDeque<mpsc::Receiver<object_store::Result<()>>>,
    written: u64,
}

impl fmt::Debug for ObjectWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectWriter")
            .field("url", &self.url)
            .field("written", &self.written)
            .finish_non_exhaustive()
    }
}

impl ObjectWriter {
    /// A writer of the object at `url` (`s3://bucket/key`); no request is made yet.
    pub fn create(url: &str, options: &S3Options) -> Result<Self, ShardError> {
        let location = ObjectUrl::parse(url)?;
        let store = client(options, url, &location)?;
        Self::in_store(url, store, options)
    }

    /// A writer of the object at `url` in `store`.
    fn in_store(
        url: &str,
        store: Arc<dyn ObjectStore>,
        options: &S3Options,
    ) -> Result<Self, ShardError> {
        let location = ObjectUrl::parse(url)?;
        let path = location.path(url)?;
        let part_bytes = usize::try_from(options.chunk_bytes.max(MIN_PART)).unwrap_or(usize::MAX);
        Ok(Self {
            url: url.to_string(),
            location,
            store,
            path,
            options: options.clone(),
            part_bytes,
            buffer: Vec::new(),
            upload: None,
            parts: VecDeque::new(),
            written: 0,
        })
    }

    /// Completes the upload (or puts a small object whole) and returns the object's size.
    pub fn finish(mut self) -> io::Result<u64> {
        let Some(mut upload) = self.upload.take() else {
            let last = LastStatus::default();
            let options = PutOptions {
                extensions: last.extensions(),
                ..PutOptions::default()
            };
            let (store, path) = (Arc::clone(&self.store), self.path.clone());
            let payload = PutPayload::from(std::mem::take(&mut self.buffer));
            wait(&self.options, async move {
                store.put_opts(&path, payload, options).await
            })
            .map_err(|error| self.io_error(&error, &last))?;
            return Ok(self.written);
        };
        if !self.buffer.is_empty() {
            self.send_part(&mut upload)?;
        }
        while let Some(part) = self.parts.pop_front() {
            let answer = part.recv().unwrap_or_else(|_| Err(dropped()));
            if let Err(error) = answer {
                self.abort(upload);
                return Err(self.io_error(&error, &LastStatus::default()));
            }
        }
        let completed = run(&self.options, async move {
            let result = upload.complete().await;
            (upload, result)
        });
        match completed {
            Some((_, Ok(_))) => Ok(self.written),
            Some((upload, Err(error))) => {
                self.abort(upload);
                Err(self.io_error(&error, &LastStatus::default()))
            }
            None => Err(self.io_error(&dropped(), &LastStatus::default())),
        }
    }

    /// Sends the buffer as the next part, after waiting for the oldest part when
    /// [`PARTS_IN_FLIGHT`] are out.
    fn send_part(&mut self, upload: &mut Box<dyn MultipartUpload>) -> io::Result<()> {
        while self.parts.len() >= PARTS_IN_FLIGHT {
            let oldest = self.parts.pop_front().map(|part| part.recv());
            if let Some(answer) = oldest {
                answer
                    .unwrap_or_else(|_| Err(dropped()))
                    .map_err(|error| self.io_error(&error, &LastStatus::default()))?;
            }
        }
        let payload = PutPayload::from(std::mem::take(&mut self.buffer));
        let part = upload.put_part(payload);
        let (send, answer) = mpsc::sync_channel(1);
        shared(&self.options).runtime.spawn(async move {
            let _ = send.send(part.await);
        });
        self.parts.push_back(answer);
        Ok(())
    }

    /// Starts the multipart upload, on the first full part.
    fn start_upload(&mut self) -> io::Result<Box<dyn MultipartUpload>> {
        let last = LastStatus::default();
        let options = PutMultipartOptions {
            extensions: last.extensions(),
            ..PutMultipartOptions::default()
        };
        let (store, path) = (Arc::clone(&self.store), self.path.clone());
        wait(&self.options, async move {
            store.put_multipart_opts(&path, options).await
        })
        .map_err(|error| self.io_error(&error, &last))
    }

    /// Aborts `upload`, so that none of its parts stay stored; a failed abort is logged.
    fn abort(&self, mut upload: Box<dyn MultipartUpload>) {
        let aborted = run(&self.options, async move { upload.abort().await });
        if let Some(Err(error)) = aborted {
            tracing::warn!(url = %self.url, error = %one_line(&error), "could not abort the upload");
        }
    }

    /// A write's failure; a 404 to a write means the bucket is missing.
    fn io_error(&self, error: &object_store::Error, last: &LastStatus) -> io::Error {
        let problem = match problem_of(error, last, self.options.attempts, None) {
            ObjectProblem::Missing => ObjectProblem::NoBucket,
            problem => problem,
        };
        io::Error::other(failure(&self.url, &self.location, problem))
    }
}

impl Write for ObjectWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let room = self.part_bytes - self.buffer.len();
        let n = buf.len().min(room);
        if self.buffer.capacity() == 0 {
            self.buffer.reserve_exact(self.part_bytes.min(1 << 20));
        }
        self.buffer.extend_from_slice(&buf[..n]);
        self.written += n as u64;
        if self.buffer.len() == self.part_bytes {
            let mut upload = match self.upload.take() {
                Some(upload) => upload,
                None => self.start_upload()?,
            };
            let sent = self.send_part(&mut upload);
            self.upload = Some(upload);
            sent?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for ObjectWriter {
    /// Unfinished: the upload is aborted.
    fn drop(&mut self) {
        if let Some(upload) = self.upload.take() {
            self.abort(upload);
        }
    }
}

/// Writes `bytes` as the object at `url` in one PUT: it appears whole or not at all.
pub fn put_object(url: &str, bytes: Vec<u8>, options: &S3Options) -> io::Result<()> {
    let mut writer = ObjectWriter::create(url, options).map_err(io::Error::other)?;
    writer.write_all(&bytes)?;
    writer.finish().map(|_| ())
}

/// Why [`copy_object`] stopped: the object could not be read, or its copy not written.
#[derive(Debug, thiserror::Error)]
pub enum ObjectCopyError {
    #[error(transparent)]
    Read(#[from] ShardError),
    #[error("writing the copy of {url}: {error}")]
    Write { url: String, error: io::Error },
}

impl ObjectCopyError {
    /// The store's answer, when that is what stopped the copy.
    pub fn problem(&self) -> Option<&ObjectProblem> {
        match self {
            Self::Read(ShardError::Object { problem, .. }) => Some(problem),
            _ => None,
        }
    }
}

/// Copies the object at `url` into `out`, in ranged reads as a shard is read (retried and
/// resumed alike, every range checked against the ETag the object had when the copy
/// began); returns its size.
pub fn copy_object(
    url: &str,
    out: &mut dyn Write,
    options: &S3Options,
) -> Result<u64, ObjectCopyError> {
    let source = S3Source {
        options: options.clone(),
    };
    let (mut reader, _) = source.open_sized(url)?;
    let mut buffer = vec![0u8; 1 << 20];
    let mut copied = 0u64;
    loop {
        let n = match reader.read(&mut buffer) {
            Ok(0) => return Ok(copied),
            Ok(n) => n,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => {
                let failure = error
                    .get_ref()
                    .and_then(|e| e.downcast_ref::<ObjectFailure>());
                return Err(failure
                    .map(ObjectFailure::to_shard_error)
                    .unwrap_or(ShardError::Read {
                        url: url.to_string(),
                        offset: copied,
                        error,
                    })
                    .into());
            }
        };
        out.write_all(&buffer[..n])
            .map_err(|error| ObjectCopyError::Write {
                url: url.to_string(),
                error,
            })?;
        copied += n as u64;
    }
}

/// The `s3://` URLs of every object under `prefix` (`s3://bucket/folder/`, taken as a
/// folder whether or not it ends in `/`), at any depth, in key order.
pub fn list_objects(prefix: &str, options: &S3Options) -> Result<Vec<String>, ShardError> {
    let location = ObjectUrl::parse(prefix)?;
    let store = client(options, prefix, &location)?;
    let folder = ObjectPath::from(location.key.trim_end_matches('/'));
    let last = LastStatus::default();
    let listed = wait(options, async move {
        store.list(Some(&folder)).try_collect::<Vec<_>>().await
    });
    let objects = listed.map_err(|error| {
        let problem = problem_of(&error, &last, options.attempts, None);
        failure(prefix, &location, problem).to_shard_error()
    })?;
    let mut urls: Vec<String> = objects
        .into_iter()
        .map(|meta| location.with_key(meta.location.as_ref()))
        .collect();
    urls.sort();
    Ok(urls)
}

/// Deletes the object at `url`; one that is not there is no error.
pub fn delete_object(url: &str, options: &S3Options) -> Result<(), ShardError> {
    let location = ObjectUrl::parse(url)?;
    let store = client(options, url, &location)?;
    let path = location.path(url)?;
    let last = LastStatus::default();
    let deleted = wait(options, async move { store.delete(&path).await });
    match deleted {
        Ok(()) => Ok(()),
        Err(error) => match problem_of(&error, &last, options.attempts, None) {
            ObjectProblem::Missing => Ok(()),
            problem => Err(failure(url, &location, problem).to_shard_error()),
        },
    }
}

/// The status of the last answer to one request, over all its retries: object_store's
/// errors keep it in a type of their own that they do not export. Travels to the HTTP
/// layer in the request's extensions, where [`Observed`] writes it.
#[derive(Debug, Clone, Default)]
struct LastStatus(Arc<AtomicU16>);

impl LastStatus {
    fn extensions(&self) -> Extensions {
        let mut extensions = Extensions::new();
        extensions.insert(self.clone());
        extensions
    }

    /// The last status answered; 0 when nothing was.
    fn get(&self) -> u16 {
        self.0.load(Ordering::Relaxed)
    }
}

/// object_store's reqwest client, seen through [`Observed`].
#[derive(Debug)]
struct ObservingConnector;

impl HttpConnector for ObservingConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let inner = ReqwestConnector::default().connect(options)?;
        Ok(HttpClient::new(Observed { inner }))
    }
}

/// Writes each answer's status into the request's [`LastStatus`].
#[derive(Debug)]
struct Observed {
    inner: HttpClient,
}

#[async_trait::async_trait]
impl HttpService for Observed {
    async fn call(&self, request: HttpRequest) -> Result<HttpResponse, HttpError> {
        let last = request.extensions().get::<LastStatus>().cloned();
        let response = self.inner.execute(request).await?;
        if let Some(last) = last {
            last.0.store(response.status().as_u16(), Ordering::Relaxed);
        }
        Ok(response)
    }
}

/// What went wrong, from object_store's error kind and the last status answered. A
/// failed `If-Match` is [`ObjectProblem::Changed`], also where object_store wrapped it
/// (a resumed body whose retry found another ETag).
fn problem_of(
    error: &object_store::Error,
    last: &LastStatus,
    attempts: u32,
    etag: Option<&str>,
) -> ObjectProblem {
    let changed = || ObjectProblem::Changed {
        etag: etag.unwrap_or("unknown").to_string(),
    };
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = cause {
        if let Some(object_store::Error::Precondition { .. }) =
            e.downcast_ref::<object_store::Error>()
        {
            return changed();
        }
        cause = e.source();
    }
    match (error, last.get()) {
        (object_store::Error::NotFound { .. }, _) | (_, 404) => ObjectProblem::Missing,
        (object_store::Error::PermissionDenied { .. }, _) => ObjectProblem::Denied { status: 403 },
        (object_store::Error::Unauthenticated { .. }, _) => ObjectProblem::Denied { status: 401 },
        (_, status @ (401 | 403)) => ObjectProblem::Denied { status },
        (_, 412) => changed(),
        (_, 503) => ObjectProblem::Throttled { attempts },
        (_, status) if status >= 300 => ObjectProblem::Status { status },
        _ => ObjectProblem::Failed {
            reason: one_line(error),
        },
    }
}

/// Where a bucket is and who reads it, resolved from the configuration, the environment
/// and the AWS files, in the AWS tools' order.
/// Its `Debug` shows no key: [`Keys`]' says only where they come from.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Settings {
    region: String,
    endpoint: Option<String>,
    keys: Keys,
}

/// Whose keys sign the requests.
#[derive(Clone, PartialEq, Eq)]
enum Keys {
    /// Unsigned requests (`s3.anonymous`).
    Anonymous,
    /// From `AWS_ACCESS_KEY_ID` and the rest, which object_store reads itself.
    Environment,
    /// A profile's keys from the shared credentials or config file.
    Profile {
        id: String,
        secret: String,
        token: Option<String>,
    },
    /// None found here: object_store's own chain (web identity, container, instance).
    Chain,
}

impl fmt::Debug for Keys {
    /// Never the keys themselves.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Anonymous => "Anonymous",
            Self::Environment => "Environment",
            Self::Profile { .. } => "Profile",
            Self::Chain => "Chain",
        })
    }
}

impl Settings {
    /// Resolves the settings from `options`, the environment (`env`) and the files
    /// (`read`; `None` for a file that is not there). Only a profile named explicitly
    /// (`s3.profile`, `AWS_PROFILE`) must exist.
    fn resolve(
        options: &S3Options,
        env: &dyn Fn(&str) -> Option<String>,
        read: &dyn Fn(&Path) -> Option<String>,
    ) -> Result<Self, String> {
        let var = |name: &str| env(name).filter(|v| !v.is_empty());
        let home = var("HOME").map(PathBuf::from).unwrap_or_default();
        let file = |variable: &str, default: &str| {
            var(variable)
                .map(PathBuf::from)
                .unwrap_or_else(|| home.join(".aws").join(default))
        };
        let credentials_file = file("AWS_SHARED_CREDENTIALS_FILE", "credentials");
        let config_file = file("AWS_CONFIG_FILE", "config");
        let named = options.profile.clone().or_else(|| var("AWS_PROFILE"));
        let profile_name = named.clone().unwrap_or_else(|| "default".to_string());
        let credentials = read(&credentials_file)
            .map(|text| parse_ini(&text))
            .unwrap_or_default();
        let config = read(&config_file)
            .map(|text| parse_ini(&text))
            .unwrap_or_default();
        let config_section = if profile_name == "default" {
            "default".to_string()
        } else {
            format!("profile {profile_name}")
        };
        let from_credentials = credentials.get(&profile_name);
        let from_config = config.get(&config_section);
        if named.is_some() && from_credentials.is_none() && from_config.is_none() {
            return Err(format!(
                "AWS profile `{profile_name}` is in neither {} nor {}",
                credentials_file.display(),
                config_file.display()
            ));
        }
        let profile = |key: &str| {
            from_credentials
                .and_then(|section| section.get(key))
                .or_else(|| from_config.and_then(|section| section.get(key)))
                .cloned()
        };
        let region = options
            .region
            .clone()
            .or_else(|| var("AWS_REGION"))
            .or_else(|| var("AWS_DEFAULT_REGION"))
            .or_else(|| profile("region"))
            .unwrap_or_else(|| "us-east-1".to_string());
        let endpoint = options
            .endpoint
            .clone()
            .or_else(|| var("AWS_ENDPOINT_URL_S3"))
            .or_else(|| var("AWS_ENDPOINT_URL"))
            .or_else(|| profile("endpoint_url"));
        let keys = if options.anonymous {
            Keys::Anonymous
        } else if var("AWS_ACCESS_KEY_ID").is_some() {
            if var("AWS_SECRET_ACCESS_KEY").is_none() {
                return Err("AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not".into());
            }
            Keys::Environment
        } else {
            match (
                profile("aws_access_key_id"),
                profile("aws_secret_access_key"),
            ) {
                (Some(id), Some(secret)) => Keys::Profile {
                    id,
                    secret,
                    token: profile("aws_session_token"),
                },
                (Some(_), None) => {
                    return Err(format!(
                        "AWS profile `{profile_name}` has aws_access_key_id but no \
                         aws_secret_access_key"
                    ));
                }
                _ => Keys::Chain,
            }
        };
        Ok(Self {
            region,
            endpoint,
            keys,
        })
    }

    /// A client builder for `bucket` with these settings, on top of what object_store
    /// reads from the environment itself (the credential chain's variables).
    fn builder(&self, bucket: &str, options: &S3Options) -> AmazonS3Builder {
        let plain_http = self
            .endpoint
            .as_deref()
            .is_some_and(|e| e.starts_with("http://"));
        let client = client_options(options, plain_http);
        let retry = retry_config(options);
        let mut builder = AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_region(&self.region)
            .with_client_options(client)
            .with_retry(retry)
            .with_http_connector(ObservingConnector);
        if let Some(endpoint) = &self.endpoint {
            builder = builder.with_endpoint(endpoint);
        }
        match &self.keys {
            Keys::Anonymous => builder = builder.with_skip_signature(true),
            Keys::Profile { id, secret, token } => {
                builder = builder
                    .with_access_key_id(id)
                    .with_secret_access_key(secret);
                if let Some(token) = token {
                    builder = builder.with_token(token);
                }
            }
            Keys::Environment | Keys::Chain => {}
        }
        builder
    }
}

/// The HTTP client's timeouts for every store; `plain_http` allows an `http://` endpoint.
fn client_options(options: &S3Options, plain_http: bool) -> ClientOptions {
    ClientOptions::new()
        .with_timeout(options.request_timeout)
        .with_connect_timeout(
            options
                .request_timeout
                .min(std::time::Duration::from_secs(10)),
        )
        .with_allow_http(plain_http)
}

/// `options.attempts` tries of a request, with backoff, within that many timeouts.
fn retry_config(options: &S3Options) -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig::default(),
        max_retries: options.attempts.saturating_sub(1) as usize,
        retry_timeout: options
            .request_timeout
            .saturating_mul(options.attempts.max(1)),
    }
}

/// The sections of an AWS credentials or config file: `[name]` headers, `key = value`
/// lines, `#` and `;` comments. Keys are lower-cased, as the AWS tools read them.
fn parse_ini(text: &str) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut sections: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            let name = name.trim().to_string();
            sections.entry(name.clone()).or_default();
            current = Some(name);
        } else if let (Some(section), Some((key, value))) = (&current, line.split_once('=')) {
            sections
                .entry(section.clone())
                .or_default()
                .insert(key.trim().to_ascii_lowercase(), value.trim().to_string());
        }
    }
    sections
}

#[cfg(test)]
mod tests {
    use object_store::PutPayload;
    use object_store::memory::InMemory;

    use super::*;

    #[test]
    fn urls_name_a_bucket_and_a_key() {
        let good = [
            (
                "s3://shards/train/a-000000.tar",
                "shards",
                "train/a-000000.tar",
            ),
            ("s3://b.example/x.tar", "b.example", "x.tar"),
            ("az://container/train/x.tar", "container", "train/x.tar"),
        ];
        for (url, bucket, key) in good {
            let parsed = ObjectUrl::parse(url).expect(url);
            assert_eq!((parsed.bucket.as_str(), parsed.key.as_str()), (bucket, key));
            assert!(is_object_url(url));
            assert_eq!(parsed.with_key(key), url, "the URL again from its parts");
        }
        for url in [
            "s3://",
            "s3://bucket",
            "s3://bucket/",
            "s3:///key",
            "az://container",
            "az:///key",
            "gs://bucket/key",
            "http://b/k",
        ] {
            let error = ObjectUrl::parse(url).expect_err(url);
            assert!(matches!(error, ShardError::BadUrl { .. }), "{url}: {error}");
            assert!(error.to_string().contains(url), "{error}");
        }
    }

    #[test]
    fn patterns_match_keys_within_their_folder() {
        let cases = [
            ("train/a-*.tar", "train/a-000001.tar", true),
            ("train/a-*.tar", "train/a-.tar", true),
            ("train/a-*.tar", "train/b-000001.tar", false),
            ("train/a-*.tar", "train/a-000001.tar.gz", false),
            ("train/a-*.tar", "train/sub/a-1.tar", false),
            ("train/*", "train/x", true),
            ("train/*", "train/sub/x", false),
            ("train/a-??.tar", "train/a-01.tar", true),
            ("train/a-??.tar", "train/a-001.tar", false),
            ("*.tar", "a.tar", true),
            ("*-*.tar", "a-b-c.tar", true),
            ("exact.tar", "exact.tar", true),
        ];
        for (pattern, key, want) in cases {
            assert_eq!(glob_match(pattern, key), want, "{pattern} against {key}");
        }
        assert_eq!(list_prefix("train/a-*.tar"), "train/a-");
        assert!(is_pattern("s3://b/train/*.tar"));
        assert!(!is_pattern("s3://b/train/a.tar"));
        assert!(!is_pattern("/data/*.tar"));
        assert!(!is_pattern("s3://b*/x.tar"));
        assert!(is_pattern("az://c/train/*.tar"));
        assert!(!is_pattern("az://c/train/a.tar"));
    }

    /// The environment and files of one case, and what resolves from them.
    fn resolve(
        options: &S3Options,
        env: &[(&str, &str)],
        files: &[(&str, &str)],
    ) -> Result<Settings, String> {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let files: HashMap<PathBuf, String> = files
            .iter()
            .map(|(k, v)| (PathBuf::from(k), v.to_string()))
            .collect();
        Settings::resolve(options, &|name| env.get(name).cloned(), &|path| {
            files.get(path).cloned()
        })
    }

    #[test]
    fn settings_come_from_config_then_environment_then_profile() {
        let home = [("HOME", "/home/u")];
        let credentials = "[default]\naws_access_key_id = AKIDEFAULT\naws_secret_access_key = s3cret\n\
             # a comment\n[work]\naws_access_key_id=AKIWORK\naws_secret_access_key=w0rk\n\
             aws_session_token = tok\n";
        let config = "[default]\nregion = eu-west-1\n[profile work]\nregion = us-west-2\n\
                      endpoint_url = http://minio:9000\n";
        let files = [
            ("/home/u/.aws/credentials", credentials),
            ("/home/u/.aws/config", config),
        ];
        let defaults = S3Options::default();

        let from_files = resolve(&defaults, &home, &files).expect("default profile");
        assert_eq!(from_files.region, "eu-west-1");
        assert_eq!(from_files.endpoint, None);
        assert!(
            matches!(&from_files.keys, Keys::Profile { id, token: None, .. } if id == "AKIDEFAULT")
        );

        let work = [("HOME", "/home/u"), ("AWS_PROFILE", "work")];
        let from_work = resolve(&defaults, &work, &files).expect("work profile");
        assert_eq!(from_work.region, "us-west-2");
        assert_eq!(from_work.endpoint.as_deref(), Some("http://minio:9000"));
        assert!(
            matches!(&from_work.keys, Keys::Profile { id, token: Some(t), .. }
            if id == "AKIWORK" && t == "tok")
        );

        let env = [
            ("HOME", "/home/u"),
            ("AWS_ACCESS_KEY_ID", "AKIENV"),
            ("AWS_SECRET_ACCESS_KEY", "e"),
            ("AWS_DEFAULT_REGION", "ap-south-1"),
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:5000"),
        ];
        let from_env = resolve(&defaults, &env, &files).expect("environment");
        assert_eq!(from_env.keys, Keys::Environment);
        assert_eq!(from_env.region, "ap-south-1");
        assert_eq!(from_env.endpoint.as_deref(), Some("http://127.0.0.1:5000"));

        let configured = S3Options {
            endpoint: Some("https://storage.googleapis.com".into()),
            region: Some("auto".into()),
            anonymous: true,
            ..S3Options::default()
        };
        let set = resolve(&configured, &env, &files).expect("configured");
        assert_eq!(set.keys, Keys::Anonymous);
        assert_eq!(set.region, "auto");
        assert_eq!(
            set.endpoint.as_deref(),
            Some("https://storage.googleapis.com")
        );

        let bare = resolve(&defaults, &home, &[]).expect("nothing at all");
        assert_eq!(
            (bare.region.as_str(), bare.keys),
            ("us-east-1", Keys::Chain)
        );

        let missing = [("HOME", "/home/u"), ("AWS_PROFILE", "nope")];
        let error = resolve(&defaults, &missing, &files).expect_err("missing profile");
        assert!(
            error.contains("`nope`") && error.contains("/home/u/.aws/credentials"),
            "{error}"
        );
        let half = [("AWS_ACCESS_KEY_ID", "AKI")];
        let error = resolve(&defaults, &half, &[]).expect_err("half the keys");
        assert!(error.contains("AWS_SECRET_ACCESS_KEY"), "{error}");
    }

    #[test]
    fn no_debug_output_holds_a_secret() {
        let files = [(
            "/h/.aws/credentials",
            "[default]\naws_access_key_id=AKIDSECRETID\naws_secret_access_key=VerySecret\n",
        )];
        let settings = resolve(&S3Options::default(), &[("HOME", "/h")], &files).expect("ok");
        let shown = format!("{settings:?}");
        assert!(
            !shown.contains("AKIDSECRETID") && !shown.contains("VerySecret"),
            "{shown}"
        );
    }

    /// An object of `len` bytes in a store in memory, opened as the source opens one.
    fn object_in_memory(len: usize) -> (Arc<InMemory>, Arc<Object>, Vec<u8>) {
        let store = Arc::new(InMemory::new());
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
        let path = ObjectPath::from("train/a.tar");
        let (put_store, put_path, payload) = (
            Arc::clone(&store),
            path.clone(),
            PutPayload::from(bytes.clone()),
        );
        let options = S3Options::default();
        let put = wait(
            &options,
            async move { put_store.put(&put_path, payload).await },
        )
        .expect("put");
        let object = Object {
            url: "s3://shards/train/a.tar".into(),
            location: ObjectUrl::parse("s3://shards/train/a.tar").expect("url"),
            store: store.clone(),
            path,
            size: len as u64,
            etag: put.e_tag,
            attempts: 1,
        };
        (store, Arc::new(object), bytes)
    }

    fn small_chunks() -> S3Options {
        S3Options {
            chunk_bytes: 1000,
            chunks_in_flight: 3,
            ..S3Options::default()
        }
    }

    #[test]
    fn ranges_come_back_in_order_as_the_whole_object() {
        for len in [0, 1, 999, 1000, 1001, 12_345] {
            let (_store, object, bytes) = object_in_memory(len);
            let mut reader = RangedReader::new(object, &small_chunks());
            let mut read = Vec::new();
            // Small reads, so that ranges are split across them.
            let mut buf = [0; 333];
            loop {
                let n = reader.read(&mut buf).expect("read");
                if n == 0 {
                    break;
                }
                read.extend_from_slice(&buf[..n]);
            }
            assert_eq!(read, bytes, "an object of {len} bytes");
        }
    }

    #[test]
    fn an_object_replaced_mid_read_fails_with_its_etag() {
        let (store, object, _) = object_in_memory(10_000);
        let etag = object.etag.clone().expect("the memory store gives ETags");
        let mut reader = RangedReader::new(Arc::clone(&object), &small_chunks());
        let mut buf = vec![0; 4000];
        reader.read_exact(&mut buf).expect("the first ranges");
        let (path, payload) = (object.path.clone(), PutPayload::from(vec![1u8; 10_000]));
        wait(&S3Options::default(), async move {
            store.put(&path, payload).await
        })
        .expect("replace");
        let error = std::io::copy(&mut reader, &mut std::io::sink()).expect_err("changed");
        let shard = crate::source::source_failure(&error).expect("an object failure");
        match &shard {
            ShardError::Object {
                problem: ObjectProblem::Changed { etag: was },
                bucket,
                key,
                ..
            } => {
                assert_eq!(
                    (was, bucket.as_str(), key.as_str()),
                    (&etag, "shards", "train/a.tar")
                );
            }
            other => panic!("not a change: {other}"),
        }
        assert!(
            shard.to_string().contains("s3://shards/train/a.tar"),
            "{shard}"
        );
        // The failure sticks.
        let again = reader.read(&mut buf).expect_err("still failed");
        assert!(crate::source::source_failure(&again).is_some());
    }

    /// The object at `key` in `store`, or `None`.
    fn stored(store: &Arc<InMemory>, key: &str) -> Option<Vec<u8>> {
        let (store, path) = (Arc::clone(store), ObjectPath::from(key));
        wait(&S3Options::default(), async move {
            store.get(&path).await?.bytes().await
        })
        .ok()
        .map(|bytes| bytes.to_vec())
    }

    #[test]
    fn objects_appear_whole_when_finished_and_never_when_dropped() {
        let store = Arc::new(InMemory::new());
        let options = S3Options {
            chunk_bytes: 1,
            ..S3Options::default()
        };
        // Parts are 5 MiB at least: 12 MiB goes up in three, 1 KiB in one PUT.
        for (key, len) in [("big.tar", 12 << 20), ("small.json", 1024), ("empty", 0)] {
            let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let url = format!("s3://shards/{key}");
            let mut writer = ObjectWriter::in_store(&url, store.clone(), &options).expect("writer");
            for piece in bytes.chunks(777_777) {
                writer.write_all(piece).expect("write");
            }
            assert_eq!(stored(&store, key), None, "{key}: visible before its end");
            assert_eq!(writer.finish().expect("finish"), len as u64);
            assert_eq!(stored(&store, key), Some(bytes), "{key}");
        }
        let mut dropped =
            ObjectWriter::in_store("s3://shards/gone.tar", store.clone(), &options).expect("w");
        dropped
            .write_all(&vec![7u8; 11 << 20])
            .expect("write two parts");
        drop(dropped);
        assert_eq!(stored(&store, "gone.tar"), None, "an unfinished object");
    }

    #[test]
    fn a_missing_object_is_missing() {
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let last = LastStatus::default();
        let error = wait(&S3Options::default(), async move {
            store.head(&ObjectPath::from("nope.tar")).await
        })
        .expect_err("missing");
        assert_eq!(problem_of(&error, &last, 3, None), ObjectProblem::Missing);
        last.0.store(503, Ordering::Relaxed);
        let generic = object_store::Error::Generic {
            store: "S3",
            source: "gave up".into(),
        };
        assert_eq!(
            problem_of(&generic, &last, 3, None),
            ObjectProblem::Throttled { attempts: 3 }
        );
        last.0.store(0, Ordering::Relaxed);
        assert!(matches!(
            problem_of(&generic, &last, 3, None),
            ObjectProblem::Failed { .. }
        ));
    }
}
