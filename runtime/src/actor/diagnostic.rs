//! Diagnostic actors, registered in every `imgrun` binary: the kind `echo`, to see a
//! cluster place, start, call, fail and stop actors without any training code.
//!
//! Methods of `echo` (payloads and results are UTF-8 text unless said otherwise):
//! - `echo`: returns the payload, bytes as they came;
//! - `pid`: the id of the process the actor runs in (a worker's, or the daemon's);
//! - `gpus`: JSON `{"cuda_visible_devices": "1,3" or null, "reserved": [1, 3],
//!   "ordinals": [0, 1]}`: what the process sees and what the actor was given;
//! - `data_ip`: the address the actor's own listeners bind (its node daemon's);
//! - `sleep`: sleeps the payload's milliseconds (at most 10 minutes), then returns it;
//! - `fail`: fails the actor (a fatal error whose message is the payload), for tests of
//!   failures and restarts;
//! - `fail_elsewhere`: the same, the failure marked as following from another actor's
//!   ([`MethodError::caused_elsewhere`]), for tests of failure origins;
//! - `exit`: ends the actor's worker process at once with the payload as exit code, for
//!   tests of crashes. Refused in a daemon (an actor with no process group), which it
//!   would take down with every actor in it.

use std::time::Duration;

use super::process::GROUP_VARIABLE;
use super::registry::{Actor, ActorContext, ActorRegistry, MethodError};

/// The kind name of the diagnostic actor.
pub const ECHO_KIND: &str = "echo";

/// The longest `sleep` honoured.
const MAX_SLEEP: Duration = Duration::from_secs(600);

/// A registry with the diagnostic kinds (`echo`). The binary adds its own kinds to it.
pub fn diagnostic_registry() -> ActorRegistry {
    let mut registry = ActorRegistry::new();
    registry.register(ECHO_KIND, |context, _args| {
        Ok(Box::new(Echo {
            context: context.clone(),
        }) as Box<dyn Actor>)
    });
    registry
}

struct Echo {
    context: ActorContext,
}

impl Actor for Echo {
    fn call(&mut self, method: &str, payload: &[u8]) -> Result<Vec<u8>, MethodError> {
        let text = || std::str::from_utf8(payload).map(str::trim);
        match method {
            "echo" => Ok(payload.to_vec()),
            "pid" => Ok(std::process::id().to_string().into_bytes()),
            "gpus" => {
                let seen = std::env::var("CUDA_VISIBLE_DEVICES").ok();
                let report = serde_json::json!({
                    "cuda_visible_devices": seen,
                    "reserved": self.context.gpus(),
                    "ordinals": self.context.cuda_ordinals(),
                });
                Ok(report.to_string().into_bytes())
            }
            "data_ip" => Ok(self.context.data_ip().to_string().into_bytes()),
            "sleep" => {
                let ms: u64 = text()?.parse()?;
                std::thread::sleep(Duration::from_millis(ms).min(MAX_SLEEP));
                Ok(payload.to_vec())
            }
            "fail" => Err(MethodError::fatal(String::from_utf8_lossy(payload))),
            "fail_elsewhere" => {
                Err(MethodError::fatal(String::from_utf8_lossy(payload)).caused_elsewhere())
            }
            "exit" => {
                if std::env::var_os(GROUP_VARIABLE).is_none() {
                    return Err(MethodError::new(
                        "exit is refused in a daemon: spawn the actor in a process group",
                    ));
                }
                let code: i32 = text()?.parse()?;
                std::process::exit(code)
            }
            other => Err(MethodError::new(format!(
                "no method '{other}' (echo has echo, pid, gpus, data_ip, sleep, fail, \
                 fail_elsewhere, exit)"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actor::ActorId;

    fn echo() -> Box<dyn Actor> {
        let context = ActorContext::new(ActorId(1), vec![3], vec![0], [10, 0, 0, 7].into());
        let registry = diagnostic_registry();
        let factory = registry.factory(ECHO_KIND).expect("echo is registered");
        factory(&context, &[]).expect("echo builds")
    }

    #[test]
    fn echo_answers_its_methods() {
        let mut actor = echo();
        let text = |result: Result<Vec<u8>, MethodError>| match result {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(error) => format!("{error:?}"),
        };
        let cases = [
            ("echo", "hi", "hi".to_string()),
            ("pid", "", std::process::id().to_string()),
            ("sleep", "1", "1".to_string()),
            (
                "sleep",
                "soon",
                "MethodError(error: \"invalid digit found in string\")".into(),
            ),
            ("data_ip", "", "10.0.0.7".into()),
            (
                "fail",
                "on purpose",
                "MethodError(fatal: \"on purpose\")".into(),
            ),
            (
                "fail_elsewhere",
                "peer gone",
                "MethodError(fatal, caused elsewhere: \"peer gone\")".into(),
            ),
            (
                "exit",
                "3",
                "MethodError(error: \"exit is refused in a daemon: spawn the actor in a \
                 process group\")"
                    .into(),
            ),
            (
                "nap",
                "",
                "MethodError(error: \"no method 'nap' (echo has echo, pid, gpus, data_ip, sleep, \
                 fail, fail_elsewhere, exit)\")"
                    .into(),
            ),
        ];
        for (method, payload, want) in cases {
            assert_eq!(
                text(actor.call(method, payload.as_bytes())),
                want,
                "{method}"
            );
        }
        let gpus: serde_json::Value =
            serde_json::from_slice(&actor.call("gpus", b"").expect("gpus")).expect("json");
        assert_eq!(gpus["reserved"], serde_json::json!([3]));
        assert_eq!(gpus["ordinals"], serde_json::json!([0]));
    }
}
