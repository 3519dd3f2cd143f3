//! [`ActorId`]: an actor's name for the life of its head. A leaf: every other file of the
//! folder may use it.

use std::fmt;

/// An actor, unique for the life of its head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ActorId(pub u64);

impl fmt::Display for ActorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
