//! [`Secret`]: 32 random bytes that the two ends of a connection prove they know, one
//! type per purpose ([`RingSecret`](crate::RingSecret),
//! [`ChannelSecret`](crate::channel::ChannelSecret)) so that one is never passed for the
//! other. `Debug` never prints the bytes.

use std::fmt;
use std::marker::PhantomData;

use crate::auth::encode_hex;

/// What a [`Secret`] is for: a marker type with the name `Debug` prints.
pub trait SecretPurpose {
    /// The name of the secret's type alias, e.g. `"RingSecret"`.
    const NAME: &'static str;
}

/// A 32-byte shared secret for the purpose `P`.
pub struct Secret<P> {
    bytes: [u8; 32],
    purpose: PhantomData<P>,
}

impl<P> Secret<P> {
    /// A fresh random secret.
    pub fn random() -> Self {
        use rand::Rng;
        Self::from_bytes(rand::rng().random())
    }

    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self {
            bytes,
            purpose: PhantomData,
        }
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.bytes
    }

    /// 64 lower-case hex digits, to pass the secret to another process.
    pub fn to_hex(&self) -> String {
        encode_hex(&self.bytes)
    }
}

// By hand: derives would ask `P: Clone`, and `Debug` must hide the bytes.
impl<P> Clone for Secret<P> {
    fn clone(&self) -> Self {
        Self::from_bytes(self.bytes)
    }
}

impl<P: SecretPurpose> fmt::Debug for Secret<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(..)", P::NAME)
    }
}
