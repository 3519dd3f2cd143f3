//! The dashboard's secrets: its token (printed once in the URL the head shows, traded by
//! the page for a session cookie), the read-only token of `/metrics` scrapers, and the
//! live sessions, each with its CSRF token. Every comparison of a secret takes the same
//! time whatever it matches.

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};

use ring::rand::{SecureRandom, SystemRandom};
use subtle::ConstantTimeEq;

/// The cookie that carries a session.
pub(super) const COOKIE: &str = "imgrun_session";

/// The most sessions kept at once; a new one beyond it ends the oldest.
const MAX_SESSIONS: usize = 64;

/// A random secret of 32 bytes, in hex.
pub(super) fn secret() -> String {
    let mut bytes = [0_u8; 32];
    // The system's random source fails only where the OS has none, which no supported
    // system lacks.
    SystemRandom::new()
        .fill(&mut bytes)
        .expect("the system's random source");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `a` equals `b`, in time that does not depend on where they differ.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

/// One session: what its cookie holds, and its CSRF token.
#[derive(Debug, Clone)]
pub(super) struct Session {
    pub id: String,
    pub csrf: String,
}

#[derive(Debug)]
pub(super) struct Sessions {
    token: String,
    metrics_token: String,
    live: Mutex<VecDeque<Session>>,
}

impl Sessions {
    pub(super) fn new(token: String, metrics_token: String) -> Self {
        Sessions {
            token,
            metrics_token,
            live: Mutex::new(VecDeque::new()),
        }
    }

    /// Whether `token` is the dashboard's token.
    pub(super) fn is_token(&self, token: &str) -> bool {
        same(token, &self.token)
    }

    /// Whether `token` is the metrics token.
    pub(super) fn is_metrics_token(&self, token: &str) -> bool {
        same(token, &self.metrics_token)
    }

    /// A new session for whoever showed the dashboard's token.
    pub(super) fn open(&self) -> Session {
        let session = Session {
            id: secret(),
            csrf: secret(),
        };
        let mut live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        if live.len() == MAX_SESSIONS {
            live.pop_front();
        }
        live.push_back(session.clone());
        session
    }

    /// The live session whose cookie holds `id`.
    pub(super) fn find(&self, id: &str) -> Option<Session> {
        let live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        // Every session is compared, so the time does not tell which one matched.
        let mut found = None;
        for session in live.iter() {
            if same(id, &session.id) {
                found = Some(session.clone());
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_is_found_by_its_id_and_the_oldest_ends_when_too_many_are_open() {
        let sessions = Sessions::new(secret(), secret());
        let first = sessions.open();
        assert_eq!(first.id.len(), 64);
        assert_ne!(first.id, first.csrf);
        assert!(sessions.find(&first.id).is_some());
        assert!(sessions.find(&first.csrf).is_none());
        assert!(sessions.find("").is_none());
        for _ in 0..MAX_SESSIONS {
            sessions.open();
        }
        assert!(
            sessions.find(&first.id).is_none(),
            "the oldest session ended"
        );
    }

    #[test]
    fn the_tokens_are_told_apart() {
        let (token, metrics) = (secret(), secret());
        let sessions = Sessions::new(token.clone(), metrics.clone());
        assert!(sessions.is_token(&token));
        assert!(!sessions.is_token(&metrics));
        assert!(sessions.is_metrics_token(&metrics));
        assert!(!sessions.is_metrics_token(&token));
        assert!(!sessions.is_token(&token[..10]));
    }
}
