#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! The crate graph is the trust boundary and the device's footprint: these tests read it with
//! `cargo tree` and fail when a crate appears where it must not (docs/architecture.md, "Crates").

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

/// Every package `package` links in normal builds (no dev or build dependencies), by name.
fn normal_dependencies(package: &str, features: &[&str]) -> BTreeSet<String> {
    normal_dependencies_with(package, features, true)
}

/// `normal_dependencies`, with or without the package's default features.
fn normal_dependencies_with(
    package: &str,
    features: &[&str],
    default_features: bool,
) -> BTreeSet<String> {
    let mut command = Command::new(env!("CARGO"));
    command.args([
        "tree",
        "--offline",
        "-e",
        "normal",
        "--prefix",
        "none",
        "-p",
        package,
    ]);
    if !features.is_empty() {
        command.args(["--features", &features.join(",")]);
    }
    if !default_features {
        command.arg("--no-default-features");
    }
    let output = command
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    assert!(
        output.status.success(),
        "cargo tree -p {package}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next().map(str::to_string))
        .collect()
}

fn assert_none_of(package: &str, found: &BTreeSet<String>, forbidden: &[&str]) {
    let present: Vec<&&str> = forbidden
        .iter()
        .filter(|name| found.contains(**name))
        .collect();
    assert!(
        present.is_empty(),
        "{package} must not link {present:?} ({} crates in all)",
        found.len()
    );
}

/// Databases, HTTP servers, DP and thread pools: none belongs on a phone.
const SERVER_SIDE: &[&str] = &[
    "confed",
    "confed-enclave",
    "confed-keyservice",
    "confed-attestation",
    "sqlx",
    "sqlx-core",
    "rusqlite",
    "libsqlite3-sys",
    "tokio-postgres",
    "axum",
    "axum-server",
    "opendp",
    "rayon",
    "utoipa",
    "google-cloud-storage",
    "blahaj",
    "aws-lc-sys",
];

#[test]
fn the_device_library_links_no_database_server_dp_or_thread_pool_crate() {
    let found = normal_dependencies("confed-device", &[]);
    assert_none_of("confed-device", &found, SERVER_SIDE);
    // The footprint the README states (171 packages on 2026-12-02; 155 before device tokens, whose
    // blind RSA brought 16, five of them proc-macros that leave no code): a jump means a new
    // heavy dependency; look at it before raising this bound.
    assert!(found.len() <= 180, "{} crates: {found:?}", found.len());
}

#[test]
fn the_protocol_crate_alone_links_no_http_stack() {
    let found = normal_dependencies("confed-protocol", &[]);
    assert_none_of(
        "confed-protocol",
        &found,
        &[SERVER_SIDE, &["reqwest", "hyper", "tokio"]].concat(),
    );
}

#[test]
fn the_key_service_links_no_front_end_database_or_enclave() {
    let found = normal_dependencies("confed-keyservice", &[]);
    assert_none_of(
        "confed-keyservice",
        &found,
        &[
            "confed",
            "confed-enclave",
            "confed-device",
            "sqlx",
            "rusqlite",
            "opendp",
            "rayon",
            "google-cloud-storage",
            "utoipa",
        ],
    );
}

#[test]
fn the_enclave_and_attestation_never_link_the_front_ends() {
    for package in ["confed-enclave", "confed-attestation"] {
        let found = normal_dependencies(package, &[]);
        assert_none_of(
            package,
            &found,
            &["confed", "confed-keyservice", "sqlx", "rusqlite", "axum"],
        );
    }
}

#[test]
fn the_production_front_end_links_no_enclave_key_service_or_issuer_code() {
    // `confed` without its `embedded` feature is what deploy/gcp/Dockerfile builds: the front
    // ends an operator runs, which must hold no key handling, noise, or the enclave's
    // OpenDP/AWS-LC/rayon (docs/architecture.md, "Crates").
    let found = normal_dependencies_with("confed", &[], false);
    assert_none_of(
        "confed --no-default-features",
        &found,
        &[
            "confed-enclave",
            "confed-keyservice",
            "confed-issuer",
            "opendp",
            "aws-lc-rs",
            "aws-lc-sys",
            "rayon",
        ],
    );
    // The shared crates it does link are the ones meant for it.
    for needed in ["confed-protocol", "confed-worker-api", "confed-dp"] {
        assert!(found.contains(needed), "{needed} missing: {found:?}");
    }
    // And the embedded default (the default features) is what brings the enclave in.
    let embedded = normal_dependencies("confed", &[]);
    assert!(embedded.contains("confed-enclave") && embedded.contains("opendp"));
}

#[test]
fn the_shared_crates_link_neither_side() {
    // What the front end and the enclave share holds nothing of either (and no OpenDP: the
    // front end's plan check is the closed form).
    for package in ["confed-worker-api", "confed-dp"] {
        let found = normal_dependencies(package, &[]);
        assert_none_of(
            package,
            &found,
            &[
                "confed",
                "confed-enclave",
                "confed-keyservice",
                "opendp",
                "aws-lc-sys",
                "rayon",
                "sqlx",
                "axum",
            ],
        );
    }
}

#[test]
fn the_operator_crate_links_no_role_and_no_web_framework() {
    // Every process links confed-ops, the enclave image too: it must bring none of a role's
    // code, and no axum into the enclave (its listener is hyper's HTTP/1 server alone).
    let found = normal_dependencies("confed-ops", &[]);
    assert_none_of(
        "confed-ops",
        &found,
        &[
            "confed",
            "confed-protocol",
            "confed-enclave",
            "confed-keyservice",
            "confed-attestation",
            "confed-serving",
            "axum",
            "axum-server",
            "tower-http",
            "sqlx",
            "reqwest",
            "opendp",
        ],
    );
    assert!(found.contains("hyper") && found.contains("metrics-process"));
}

#[test]
fn the_token_issuer_links_no_front_end_key_service_enclave_or_database() {
    let found = normal_dependencies("confed-issuer", &[]);
    assert_none_of(
        "confed-issuer",
        &found,
        &[
            "confed",
            "confed-enclave",
            "confed-keyservice",
            "confed-attestation",
            "confed-device",
            "sqlx",
            "rusqlite",
            "opendp",
            "rayon",
            "google-cloud-storage",
        ],
    );
}

/// Every source file of the workspace's crates that contains `unsafe` code is listed in
/// docs/architecture.md's "Unsafe code" table, and every file listed there has some (tests
/// excepted: they only `kill` their own children).
#[test]
fn the_unsafe_code_list_in_the_architecture_doc_names_exactly_the_files_with_unsafe() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let section = doc
        .split("\n## Unsafe code\n")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("docs/architecture.md has an \"Unsafe code\" section");
    let listed: BTreeSet<String> = section
        .lines()
        .filter(|line| line.starts_with("| `"))
        .flat_map(|line| {
            let first_cell = line.split(" | ").next().unwrap_or_default();
            first_cell
                .split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    let found = files_with_unsafe(root);
    assert_eq!(
        found, listed,
        "files with unsafe code (left) and docs/architecture.md's list (right) differ"
    );
}

/// The crates' source directories, relative to the workspace root (`src` is `confed`'s).
const CRATE_SOURCES: &[&str] = &[
    "src",
    "protocol/src",
    "device/src",
    "enclave/src",
    "attestation/src",
    "keyservice/src",
    "issuer/src",
    "serving/src",
    "worker-api/src",
    "dp/src",
    "ops/src",
];

/// Every source file of the workspace's crates with `unsafe` code in it (outside comments),
/// relative to the root.
fn files_with_unsafe(root: &std::path::Path) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut pending: Vec<std::path::PathBuf> =
        CRATE_SOURCES.iter().map(|dir| root.join(dir)).collect();
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                let has_unsafe = text.lines().any(|line| {
                    let code = line.split("//").next().unwrap_or_default();
                    code.contains("unsafe {")
                        || code.contains("unsafe impl")
                        || code.contains("unsafe fn")
                });
                if has_unsafe {
                    found.insert(
                        path.strip_prefix(root)
                            .unwrap()
                            .to_string_lossy()
                            .into_owned(),
                    );
                }
            }
        }
    }
    found
}

/// A crate with no unsafe code forbids it, so none creeps in unreviewed: its crate root (and
/// its binary's) says `#![forbid(unsafe_code)]`.
#[test]
fn every_crate_without_unsafe_code_forbids_it() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let with_unsafe = files_with_unsafe(root);
    let mut missing = Vec::new();
    for dir in CRATE_SOURCES {
        let prefix = format!("{dir}/");
        if with_unsafe.iter().any(|file| file.starts_with(&prefix)) {
            continue;
        }
        for crate_root in ["lib.rs", "main.rs"] {
            let path = root.join(dir).join(crate_root);
            if let Ok(text) = std::fs::read_to_string(&path)
                && !text.contains("#![forbid(unsafe_code)]")
            {
                missing.push(format!("{dir}/{crate_root}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "crates without unsafe code that do not forbid it: {missing:?}"
    );
}

/// The top-level modules of `src/` each file under `src/<module>` names through `crate::`,
/// skipping comments and test code (files `tests.rs` / `*_tests.rs`, and a file's trailing
/// `#[cfg(test)] mod`): module -> (module it uses -> a file that uses it).
fn module_graph(src: &Path) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut modules = BTreeSet::new();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.path().is_dir() {
            modules.insert(name);
        } else if let Some(stem) = name.strip_suffix(".rs")
            && stem != "lib"
            && stem != "main"
        {
            modules.insert(stem.to_string());
        }
    }
    let mut graph: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for path in rust_files(src) {
        let relative = path
            .strip_prefix(src)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let top = relative.split('/').next().unwrap().trim_end_matches(".rs");
        let file = path.file_name().unwrap().to_string_lossy();
        if !modules.contains(top) || file == "tests.rs" || file.ends_with("_tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let code = text.split("#[cfg(test)]\nmod ").next().unwrap();
        // The file without its comment lines, read whole: a `use crate::{...}` group may span
        // several lines.
        let code: String = code
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        for used in crate_paths(&code) {
            if used != top && modules.contains(&used) {
                graph
                    .entry(top.to_string())
                    .or_default()
                    .entry(used)
                    .or_insert_with(|| relative.clone());
            }
        }
    }
    graph
}

fn rust_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

/// The first segment after each `crate::` in `code`: `crate::a::b` gives `a`, and a group
/// `crate::{a::b, c}` gives `a` and `c` (its top level only, over as many lines as it takes).
fn crate_paths(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        let Some(group) = rest.strip_prefix('{') else {
            found.push(identifier(rest));
            continue;
        };
        let mut depth = 0;
        let mut start_of_item = true;
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => start_of_item = true,
                c if c.is_whitespace() => {}
                _ if start_of_item && depth == 0 => {
                    found.push(identifier(&group[i..]));
                    start_of_item = false;
                }
                _ => {}
            }
        }
    }
    found
}

fn identifier(text: &str) -> String {
    text.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// A cycle in `graph`, as the modules along it with the file that makes each step.
fn find_cycle(graph: &BTreeMap<String, BTreeMap<String, String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeMap<String, String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|p| p == node) {
            let mut cycle = path[start..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flat_map(|edges| edges.keys()) {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
        .map(|cycle| {
            cycle
                .windows(2)
                .map(|step| format!("{} -> {} ({})", step[0], step[1], graph[&step[0]][&step[1]]))
                .collect()
        })
}

#[test]
fn the_crate_path_reader_sees_plain_paths_and_the_top_level_of_groups() {
    assert_eq!(crate_paths("use crate::db::Db;"), ["db"]);
    assert_eq!(
        crate_paths("use crate::{api::{self, error}, blob, db::{Db, x::y}};"),
        ["api", "blob", "db"]
    );
    assert_eq!(
        crate_paths("let x = crate::a::f(crate::b::g());"),
        ["a", "b"]
    );
    let graph = BTreeMap::from([
        (
            "a".to_string(),
            BTreeMap::from([("b".to_string(), "a.rs".to_string())]),
        ),
        (
            "b".to_string(),
            BTreeMap::from([("a".to_string(), "b/mod.rs".to_string())]),
        ),
    ]);
    assert_eq!(
        find_cycle(&graph).unwrap(),
        ["a -> b (a.rs)", "b -> a (b/mod.rs)"]
    );
}

#[test]
fn no_module_of_the_front_end_depends_on_itself_through_another() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = module_graph(&src);
    assert!(
        graph.values().map(BTreeMap::len).sum::<usize>() > 40,
        "the graph reader found too few uses to be reading src/: {graph:?}"
    );
    if let Some(cycle) = find_cycle(&graph) {
        panic!(
            "modules of src/ form a cycle (docs/architecture.md, \"Layers\", says which way uses go): {}",
            cycle.join(", ")
        );
    }
}
