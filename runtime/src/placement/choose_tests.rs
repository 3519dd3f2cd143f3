//! Tests of the choice of nodes: tables of clusters, requests and where they go.

use super::*;

/// `"gpu=2 cpu=4 tpu=1"`: CPUs are whole (`cpu=500m` for thousandths), memory in GiB.
pub(crate) fn res(text: &str) -> Resources {
    let mut resources = Resources::new();
    for item in text.split_whitespace() {
        let (name, amount) = item.split_once('=').expect("name=amount");
        let amount = match (name, amount.strip_suffix('m')) {
            (Resources::CPU, Some(millis)) => millis.parse::<u64>().expect("millis"),
            (Resources::CPU, None) => amount.parse::<u64>().expect("cpus") * 1000,
            (Resources::MEMORY, _) => amount.parse::<u64>().expect("GiB") << 30,
            _ => amount.parse().expect("amount"),
        };
        resources.set(name, amount);
    }
    resources
}

/// A node: id, total, used, reservations.
type Row = (u64, &'static str, &'static str, usize);

/// The cluster of `rows` as a decision about `requests` sees it.
fn view(rows: &[Row], requests: &[Resources]) -> View {
    let mut view = View::new(requests);
    for &(node, total, used, reservations) in rows {
        view.push(NodeId(node), &res(total), &res(used), reservations);
    }
    view
}

/// The node chosen for `request`, or the error's message.
fn outcome(rows: &[Row], request: &str, strategy: Strategy) -> String {
    let request = res(request);
    match choose(
        &view(rows, std::slice::from_ref(&request)),
        &request,
        strategy,
    ) {
        Ok(node) => format!("node {node}"),
        Err(error) => error.to_string(),
    }
}

#[test]
fn one_request_goes_where_its_strategy_says() {
    use Strategy::{Node, Pack, Spread};
    let four_gpu_nodes: &[Row] = &[
        (1, "gpu=4", "", 0),
        (2, "gpu=4", "gpu=3", 3),
        (3, "gpu=4", "gpu=2", 1),
    ];
    let cases: Vec<(&str, &[Row], &str, Strategy, &str)> = vec![
        (
            "pack: fullest that fits",
            four_gpu_nodes,
            "gpu=1",
            Pack,
            "node 2",
        ),
        (
            "pack: skips a node too full",
            four_gpu_nodes,
            "gpu=2",
            Pack,
            "node 3",
        ),
        (
            "pack: only the empty node fits",
            four_gpu_nodes,
            "gpu=3",
            Pack,
            "node 1",
        ),
        (
            "spread: fewest reservations",
            four_gpu_nodes,
            "gpu=1",
            Spread,
            "node 1",
        ),
        (
            "pack: ties to the lowest id",
            &[(2, "gpu=2", "", 0), (1, "gpu=2", "", 0)],
            "gpu=1",
            Pack,
            "node 1",
        ),
        (
            "pack: scarcest resource first, then the next",
            &[
                (1, "gpu=2 cpu=8", "gpu=1", 1),
                (2, "gpu=2 cpu=8", "gpu=1 cpu=6", 1),
                (3, "gpu=2 cpu=8", "cpu=7", 1),
            ],
            "gpu=1 cpu=1",
            Pack,
            "node 2",
        ),
        (
            "pack: only requested resources count",
            &[(1, "gpu=4 cpu=8", "cpu=2", 1), (2, "cpu=8", "cpu=4", 0)],
            "cpu=1",
            Pack,
            "node 2",
        ),
        (
            "pack: an empty request goes to the lowest id",
            &[(1, "gpu=1", "gpu=1", 1), (2, "gpu=1", "", 0)],
            "",
            Pack,
            "node 1",
        ),
        (
            "spread: ties on reservations go to the most free",
            &[(1, "gpu=4", "gpu=3", 1), (2, "gpu=4", "gpu=1", 1)],
            "gpu=1",
            Spread,
            "node 2",
        ),
        (
            "spread: full ties go to the lowest id",
            &[(3, "gpu=2", "", 0), (2, "gpu=2", "", 0)],
            "gpu=1",
            Spread,
            "node 2",
        ),
        (
            "spread: skips nodes where it does not fit",
            &[(1, "gpu=1", "gpu=1", 0), (2, "gpu=4", "gpu=3", 3)],
            "gpu=1",
            Spread,
            "node 2",
        ),
        (
            "spread: an empty request goes to the least busy",
            &[(1, "cpu=1", "cpu=1", 2), (2, "cpu=8", "", 3)],
            "",
            Spread,
            "node 1",
        ),
        (
            "node: fits",
            four_gpu_nodes,
            "gpu=1",
            Node(NodeId(2)),
            "node 2",
        ),
        (
            "node: unknown",
            four_gpu_nodes,
            "gpu=1",
            Node(NodeId(9)),
            "unknown node 9",
        ),
        (
            "node: busy",
            four_gpu_nodes,
            "gpu=2",
            Node(NodeId(2)),
            "busy: needs 2 gpu on node 2; 1 free, 3 of 4 gpu in use",
        ),
        (
            "node: unsatisfiable",
            four_gpu_nodes,
            "gpu=5",
            Node(NodeId(2)),
            "unsatisfiable: needs 5 gpu on node 2; it has 4",
        ),
        (
            "node: lacks a custom resource",
            four_gpu_nodes,
            "tpu=1",
            Node(NodeId(1)),
            "unsatisfiable: needs 1 tpu on node 1; it has no tpu",
        ),
    ];
    for (name, rows, request, strategy, want) in cases {
        assert_eq!(outcome(rows, request, strategy), want, "{name}");
    }
}

#[test]
fn refusals_say_whether_waiting_helps_and_what_is_missing() {
    let cases: Vec<(&str, &[Row], &str, &str)> = vec![
        (
            "more GPUs than any node has",
            &[
                (1, "gpu=1", "", 0),
                (2, "cpu=4", "", 0),
                (3, "gpu=2", "", 0),
                (4, "gpu=2", "", 0),
            ],
            "gpu=4",
            "unsatisfiable: needs 4 gpu on one node; the largest node has 2 (node 3)",
        ),
        (
            "an unknown custom resource",
            &[(1, "gpu=1", "", 0)],
            "tpu=1",
            "unsatisfiable: needs 1 tpu on one node; no node has any tpu",
        ),
        (
            "enough of each, not on one node",
            &[(1, "gpu=2 cpu=4", "", 0), (2, "cpu=16", "", 0)],
            "gpu=2 cpu=8",
            "unsatisfiable: needs 2 gpu, 8 cpu on one node; no node has all of it",
        ),
        (
            "no nodes",
            &[],
            "gpu=1",
            "unsatisfiable: needs 1 gpu on one node; the cluster has no nodes",
        ),
        (
            "memory",
            &[(1, "memory=4", "", 0)],
            "memory=8",
            "unsatisfiable: needs 8 GiB memory on one node; the largest node has 4 GiB (node 1)",
        ),
        (
            "thousandths of a CPU",
            &[(1, "cpu=1", "", 0)],
            "cpu=1500m",
            "unsatisfiable: needs 1.5 cpu on one node; the largest node has 1 (node 1)",
        ),
        (
            "every GPU in use",
            &[(1, "gpu=2", "gpu=2", 1), (2, "gpu=2", "gpu=2", 2)],
            "gpu=1",
            "busy: needs 1 gpu on one node; 4 of 4 gpu in use",
        ),
        (
            "some free, not enough on one node",
            &[(1, "gpu=2", "gpu=1", 1), (2, "gpu=2", "gpu=1", 1)],
            "gpu=2",
            "busy: needs 2 gpu on one node; the most free is 1 (node 1), 2 of 4 gpu in use",
        ),
        (
            "enough free of each, not on one node",
            &[
                (1, "gpu=1 cpu=8", "cpu=6", 1),
                (2, "gpu=1 cpu=8", "gpu=1", 1),
            ],
            "gpu=1 cpu=4",
            "busy: needs 1 gpu, 4 cpu on one node; no node has all of it free now",
        ),
        (
            "free CPUs named in thousandths",
            &[(1, "cpu=2", "cpu=1750m", 3)],
            "cpu=1",
            "busy: needs 1 cpu on one node; the most free is 0.25 (node 1), 1.75 of 2 cpu in use",
        ),
    ];
    for (name, rows, request, want) in cases {
        for strategy in [Strategy::Pack, Strategy::Spread] {
            let got = outcome(rows, request, strategy);
            assert_eq!(got, want, "{name}, {strategy:?}");
        }
    }
}

/// A gang's case: name, cluster, requests, strategy, nodes chosen or the error.
type GangCase = (
    &'static str,
    &'static [Row],
    Vec<&'static str>,
    Strategy,
    Result<Vec<u64>, &'static str>,
);

#[test]
fn a_gang_is_placed_in_turn_or_refused_whole() {
    use Strategy::{Node, Pack, Spread};
    let two_by_two: &[Row] = &[(1, "gpu=2", "", 0), (2, "gpu=2", "", 0)];
    let uneven: &[Row] = &[(1, "gpu=4", "", 0), (2, "gpu=4", "gpu=2", 1)];
    let cases: Vec<GangCase> = vec![
        (
            "spread alternates",
            two_by_two,
            vec!["gpu=1"; 4],
            Spread,
            Ok(vec![1, 2, 1, 2]),
        ),
        (
            "pack fills one node first",
            two_by_two,
            vec!["gpu=1"; 4],
            Pack,
            Ok(vec![1, 1, 2, 2]),
        ),
        (
            "pack starts on the fuller node",
            uneven,
            vec!["gpu=1"; 4],
            Pack,
            Ok(vec![2, 2, 1, 1]),
        ),
        (
            "spread evens out",
            uneven,
            vec!["gpu=1"; 3],
            Spread,
            Ok(vec![1, 1, 2]),
        ),
        (
            "pinned",
            uneven,
            vec!["gpu=1"; 2],
            Node(NodeId(2)),
            Ok(vec![2, 2]),
        ),
        ("empty", two_by_two, vec![], Spread, Ok(vec![])),
        (
            "more than the cluster",
            two_by_two,
            vec!["gpu=1"; 5],
            Spread,
            Err(
                "unsatisfiable: 5 requests need 5 gpu in all; even an idle cluster takes only 4 of them",
            ),
        ),
        (
            "one member can never fit",
            two_by_two,
            vec!["gpu=1", "gpu=3"],
            Pack,
            Err(
                "unsatisfiable: request 2 of 2: needs 3 gpu on one node; the largest node has 2 (node 1)",
            ),
        ),
        (
            "fits when the others release",
            uneven,
            vec!["gpu=2"; 4],
            Pack,
            Err("busy: request 4 of 4: needs 2 gpu on one node; 8 of 8 gpu in use"),
        ),
        (
            "pinned beyond the node",
            uneven,
            vec!["gpu=2"; 3],
            Node(NodeId(2)),
            Err(
                "unsatisfiable: 3 requests need 6 gpu in all; even an idle cluster takes only 2 of them",
            ),
        ),
        (
            "pinned to no node",
            uneven,
            vec!["gpu=1"],
            Node(NodeId(7)),
            Err("unknown node 7"),
        ),
    ];
    for (name, rows, requests, strategy, want) in cases {
        let requests: Vec<Resources> = requests.into_iter().map(res).collect();
        let got = choose_all(&view(rows, &requests), &requests, strategy)
            .map(|nodes| nodes.iter().map(|node| node.0).collect::<Vec<_>>())
            .map_err(|error| error.to_string());
        assert_eq!(got, want.map_err(str::to_string), "{name}");
    }
}
