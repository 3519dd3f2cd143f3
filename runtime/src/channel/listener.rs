//! [`DataListener`]: accepts data channel peers that prove the secret, one handshake at a
//! time, and [`ListenerStopper`], which stops a thread blocked in its `accept`.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::stream::DataStream;
use super::{ChannelError, ChannelOptions, ChannelSecret, handshake};

/// How long [`ListenerStopper::stop`] tries to reach the listener to wake its `accept`.
const WAKE_TIMEOUT: Duration = Duration::from_secs(1);

/// A bound socket that hands out [`DataStream`]s of one [`ChannelSecret`].
#[derive(Debug)]
pub struct DataListener {
    listener: TcpListener,
    addr: SocketAddr,
    secret: ChannelSecret,
    options: ChannelOptions,
    stopped: Arc<AtomicBool>,
}

/// Stops a [`DataListener`] from any thread: the `accept` blocked on it, and every later
/// one, returns [`ChannelError::Stopped`]. Cloneable and `Send`.
#[derive(Clone, Debug)]
pub struct ListenerStopper {
    stopped: Arc<AtomicBool>,
    /// Where to connect to wake a blocked `accept` (loopback when bound to any address).
    wake: SocketAddr,
}

impl DataListener {
    /// Binds `addr` (port 0 for any free port) for channels of `secret`.
    pub fn bind(addr: SocketAddr, secret: ChannelSecret) -> Result<Self, ChannelError> {
        Self::bind_with(addr, secret, ChannelOptions::default())
    }

    /// [`DataListener::bind`] with the given options.
    pub fn bind_with(
        addr: SocketAddr,
        secret: ChannelSecret,
        options: ChannelOptions,
    ) -> Result<Self, ChannelError> {
        let bind_failed = |source| ChannelError::Bind { addr, source };
        let listener = TcpListener::bind(addr).map_err(bind_failed)?;
        let addr = listener.local_addr().map_err(bind_failed)?;
        Ok(Self {
            listener,
            addr,
            secret,
            options,
            stopped: Arc::new(AtomicBool::new(false)),
        })
    }

    /// The bound address (with the port chosen when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Blocks for the next peer that proves it knows the secret. A peer that fails the
    /// handshake (wrong secret, garbage, silence past the handshake timeout) is logged at
    /// warn with its address and dropped, and `accept` waits for the next. Returns
    /// [`ChannelError::Stopped`] once a [`ListenerStopper`] stopped the listener (at the
    /// latest one handshake timeout later, if a handshake was under way).
    pub fn accept(&self) -> Result<DataStream, ChannelError> {
        loop {
            if self.is_stopped() {
                return Err(ChannelError::Stopped { addr: self.addr });
            }
            let accepted = self.listener.accept();
            if self.is_stopped() {
                return Err(ChannelError::Stopped { addr: self.addr });
            }
            let (mut stream, peer) = match accepted {
                Ok(accepted) => accepted,
                // The peer gave up before we took it, or a signal: nothing to report.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionAborted | io::ErrorKind::Interrupted
                    ) =>
                {
                    continue;
                }
                Err(source) => {
                    return Err(ChannelError::Accept {
                        addr: self.addr,
                        source,
                    });
                }
            };
            let deadline = Instant::now() + self.options.handshake_timeout;
            let authenticated = handshake::acceptor(&mut stream, &self.secret, deadline)
                .and_then(|()| DataStream::authenticated(stream, peer).map_err(|e| e.to_string()));
            match authenticated {
                Ok(stream) => {
                    debug!(%peer, listener = %self.addr, "data channel accepted");
                    return Ok(stream);
                }
                Err(reason) => {
                    warn!(%peer, listener = %self.addr, %reason, "data channel handshake refused");
                }
            }
        }
    }

    /// A handle that stops this listener from another thread.
    pub fn stopper(&self) -> ListenerStopper {
        ListenerStopper {
            stopped: self.stopped.clone(),
            wake: wake_addr(self.addr),
        }
    }

    fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }
}

impl ListenerStopper {
    /// Stops the listener and wakes a thread blocked in its `accept`.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        // `accept` sees the flag as soon as any connection wakes it: make one. If it
        // fails, the listener is gone or `accept` will see the flag when it next returns.
        if let Err(error) = TcpStream::connect_timeout(&self.wake, WAKE_TIMEOUT) {
            debug!(listener = %self.wake, %error, "could not wake the data channel listener");
        }
    }
}

/// The address to connect to for reaching a listener bound to `addr`.
fn wake_addr(addr: SocketAddr) -> SocketAddr {
    let ip = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, addr.port())
}
