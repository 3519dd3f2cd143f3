//! Symbolic links that lead out of the served folder: refused unless `follow_links`.
//!
//! `ServeDir` refuses request paths that leave the folder but follows links. This layer
//! resolves the file a request names, as `ServeDir` builds its path, and answers 404 when
//! the real file is outside the folder's real path. (It judges links as they are when the
//! request comes; whoever can change links inside the folder can serve what they like
//! anyway.)

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use percent_encoding::percent_decode_str;

use super::Folder;

/// Answers 404 for a file reached through a link out of the folder, unless links may
/// leave it; passes everything else on.
pub(super) async fn stay_inside(
    State(folder): State<Arc<Folder>>,
    request: Request,
    next: Next,
) -> Response {
    if !folder.follow_links
        && let Some(path) = requested_path(&folder.dir, request.uri().path())
        && !inside(&folder.dir, &path).await
    {
        tracing::warn!(
            path = %request.uri().path(),
            "refused a link out of the served folder (serve.follow_links is off)"
        );
        return (StatusCode::NOT_FOUND, "not found\n").into_response();
    }
    next.run(request).await
}

/// Whether `path` is, once every link is resolved, inside `dir` (a real path). A path
/// that does not resolve (missing, a dangling link) counts as inside: nothing is served
/// from it, and `ServeDir` gives its 404.
pub(super) async fn inside(dir: &Path, path: &Path) -> bool {
    match tokio::fs::canonicalize(path).await {
        Ok(real) => real.starts_with(dir),
        Err(_) => true,
    }
}

/// The file a request path names under `dir`, built as `ServeDir` builds it (percent-
/// decoded, normal components only); `None` for a path it refuses anyway.
fn requested_path(dir: &Path, uri_path: &str) -> Option<PathBuf> {
    let decoded = percent_decode_str(uri_path.trim_start_matches('/'))
        .decode_utf8()
        .ok()?;
    let mut path = dir.to_path_buf();
    for component in Path::new(&*decoded).components() {
        match component {
            Component::Normal(part) => path.push(part),
            Component::CurDir => {}
            Component::Prefix(_) | Component::RootDir | Component::ParentDir => return None,
        }
    }
    Some(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_paths_resolve_as_serve_dir_builds_them() {
        let dir = Path::new("/srv/shards");
        let cases = [
            ("/a.tar", Some("/srv/shards/a.tar")),
            ("/sub/./b.tar", Some("/srv/shards/sub/b.tar")),
            ("/with%20space.tar", Some("/srv/shards/with space.tar")),
            ("/", Some("/srv/shards")),
            ("/../secret", None),
            ("/%2e%2e/secret", None),
            ("/sub/%2F/etc", Some("/srv/shards/sub/etc")),
            ("/%ff.tar", None),
        ];
        for (uri, expected) in cases {
            assert_eq!(
                requested_path(dir, uri),
                expected.map(PathBuf::from),
                "{uri}"
            );
        }
    }
}
