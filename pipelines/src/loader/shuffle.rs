//! The shuffle buffer of a loader worker, with WebDataset's rules: it fills to `initial`
//! samples before giving out the first, then grows by one sample per sample given out
//! until it holds `capacity`; each output is a uniformly random element of the buffer.
//! At the end of the input the rest is given out in random order.

use crate::plan::SplitMix64;

#[derive(Debug)]
pub(crate) struct ShuffleBuffer<T> {
    items: Vec<T>,
    capacity: usize,
    initial: usize,
    rng: SplitMix64,
    started: bool,
}

impl<T> ShuffleBuffer<T> {
    pub fn new(capacity: usize, initial: usize, rng: SplitMix64) -> Self {
        let capacity = capacity.max(1);
        Self {
            items: Vec::with_capacity(capacity.min(1 << 16)),
            capacity,
            initial: initial.clamp(1, capacity),
            rng,
            started: false,
        }
    }

    /// The next sample, pulling from `input` as needed (`None` from `input` means it has
    /// ended). Errors from `input` are passed through at once.
    pub fn next<E>(
        &mut self,
        input: &mut impl FnMut() -> Option<Result<T, E>>,
    ) -> Option<Result<T, E>> {
        // Two pulls per output while below capacity, so the buffer grows toward it; one
        // pull per output at capacity.
        let want = if self.started {
            (self.items.len() + 2).min(self.capacity)
        } else {
            self.initial
        };
        while self.items.len() < want.max(1) {
            match input() {
                Some(Ok(item)) => self.items.push(item),
                Some(Err(error)) => return Some(Err(error)),
                None => break,
            }
        }
        self.started = true;
        if self.items.is_empty() {
            return None;
        }
        let pick = self.rng.below(self.items.len() as u64) as usize;
        Some(Ok(self.items.swap_remove(pick)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(capacity: usize, initial: usize, n: u32, seed: u64) -> Vec<u32> {
        let mut buffer = ShuffleBuffer::new(capacity, initial, SplitMix64::new(seed));
        let mut input = 0..n;
        let mut pull = || input.next().map(Ok::<u32, ()>);
        std::iter::from_fn(|| buffer.next(&mut pull))
            .map(|r| r.expect("no errors"))
            .collect()
    }

    #[test]
    fn every_item_comes_out_once() {
        for (capacity, initial) in [(1, 1), (10, 3), (100, 100), (1000, 10)] {
            let mut out = drain(capacity, initial, 257, 7);
            out.sort_unstable();
            assert_eq!(out, (0..257).collect::<Vec<_>>(), "{capacity}/{initial}");
        }
    }

    #[test]
    fn capacity_one_keeps_the_order() {
        assert_eq!(drain(1, 1, 20, 3), (0..20).collect::<Vec<_>>());
        assert_eq!(drain(0, 0, 5, 3), (0..5).collect::<Vec<_>>());
    }

    #[test]
    fn order_depends_on_the_seed_only() {
        assert_eq!(drain(50, 10, 200, 1), drain(50, 10, 200, 1));
        assert_ne!(drain(50, 10, 200, 1), drain(50, 10, 200, 2));
        assert_ne!(drain(50, 10, 200, 1), (0..200).collect::<Vec<_>>());
    }

    #[test]
    fn an_item_moves_at_most_the_buffer_size_early() {
        // Item i cannot come out before `i - capacity` items have.
        let out = drain(16, 16, 500, 9);
        for (position, &item) in out.iter().enumerate() {
            assert!(item as usize <= position + 16, "{item} at {position}");
        }
    }

    #[test]
    fn errors_pass_straight_through() {
        let mut buffer = ShuffleBuffer::<u32>::new(10, 5, SplitMix64::new(0));
        let mut calls = 0;
        let mut pull = || {
            calls += 1;
            Some(if calls == 3 { Err("bad") } else { Ok(calls) })
        };
        assert_eq!(buffer.next(&mut pull), Some(Err("bad")));
    }
}
