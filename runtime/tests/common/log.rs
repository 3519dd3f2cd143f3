//! Log lines written to a shared buffer, for tests that read what the code logged.

use std::io::Write;
use std::sync::{Arc, Mutex};

/// A `tracing` writer into a shared buffer.
pub struct LogWriter(pub Arc<Mutex<Vec<u8>>>);

impl Write for LogWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log lock").extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
