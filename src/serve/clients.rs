//! Slots per client: every request first takes one of its client's slots (a client is a
//! peer IP address), then one of the server's. A client holds at most `per_client` of the
//! server's slots at once, so one client whose connections stop reading (each holding its
//! slot for up to the send timeout) cannot take every slot: the others keep the rest. Its
//! further requests wait behind its own, not in front of everyone's.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Each client's share of the slots, made on its first request and dropped when it holds
/// none and none of its requests waits.
#[derive(Debug)]
pub(super) struct Clients {
    per_client: usize,
    shares: Mutex<HashMap<Option<IpAddr>, Arc<Semaphore>>>,
}

/// One of a client's slots; given back (and the client forgotten when it holds no other
/// and none waits) when dropped.
#[derive(Debug)]
pub(super) struct ClientSlot {
    clients: Arc<Clients>,
    client: Option<IpAddr>,
    permit: Option<OwnedSemaphorePermit>,
}

impl Clients {
    /// `per_client` is at least 1.
    pub(super) fn new(per_client: usize) -> Arc<Self> {
        Arc::new(Self {
            per_client: per_client.max(1),
            shares: Mutex::new(HashMap::new()),
        })
    }

    /// Waits for one of `client`'s slots (`None`: a peer whose address is unknown; all
    /// such share one).
    pub(super) async fn acquire(self: &Arc<Self>, client: Option<IpAddr>) -> ClientSlot {
        let share = {
            let mut shares = self.shares.lock().unwrap_or_else(PoisonError::into_inner);
            Arc::clone(
                shares
                    .entry(client)
                    .or_insert_with(|| Arc::new(Semaphore::new(self.per_client))),
            )
        };
        // Nothing closes these semaphores, so acquiring cannot fail; were one closed, the
        // request would go on without its share rather than be refused.
        let permit = share.acquire_owned().await.ok();
        ClientSlot {
            clients: Arc::clone(self),
            client,
            permit,
        }
    }

    /// Clients with a share now (tests).
    #[cfg(test)]
    fn known(&self) -> usize {
        self.shares
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        drop(self.permit.take());
        let mut shares = self
            .clients
            .shares
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Only the map holds it: no slot is taken and no request waits for one (a waiting
        // request holds a clone while it waits).
        if shares
            .get(&self.client)
            .is_some_and(|share| Arc::strong_count(share) == 1)
        {
            shares.remove(&self.client);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn ip(last: u8) -> Option<IpAddr> {
        Some(IpAddr::from([10, 0, 0, last]))
    }

    /// Whether `client` could take a slot now.
    async fn would_get(clients: &Arc<Clients>, client: Option<IpAddr>) -> bool {
        tokio::time::timeout(Duration::from_millis(50), clients.acquire(client))
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_client_holds_at_most_its_share_and_others_are_not_held_up() {
        let clients = Clients::new(2);
        let a1 = clients.acquire(ip(1)).await;
        let _a2 = clients.acquire(ip(1)).await;
        assert!(
            !would_get(&clients, ip(1)).await,
            "a third slot for one client"
        );
        assert!(would_get(&clients, ip(2)).await, "another client waits");
        assert!(would_get(&clients, None).await, "an unknown peer waits");
        drop(a1);
        assert!(
            would_get(&clients, ip(1)).await,
            "a slot given back is not taken again"
        );
    }

    #[tokio::test]
    async fn a_client_is_forgotten_once_it_holds_nothing_and_nothing_waits() {
        let clients = Clients::new(1);
        let held = clients.acquire(ip(1)).await;
        let waiting = {
            let clients = Arc::clone(&clients);
            tokio::spawn(async move { clients.acquire(ip(1)).await })
        };
        tokio::task::yield_now().await;
        drop(held);
        let second = waiting.await.expect("the waiting request gets the slot");
        assert_eq!(
            clients.known(),
            1,
            "forgotten while a request still held a slot"
        );
        drop(second);
        assert_eq!(clients.known(), 0);
        assert_eq!(
            Clients::new(0).per_client,
            1,
            "a share of 0 would refuse everyone"
        );
    }
}
