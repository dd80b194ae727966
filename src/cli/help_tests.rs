//! The `--help` of every command, compared with the snapshot under `tests/help/` (`confed.txt`,
//! `confed-serve.txt`, `confed-tenant-create.txt`, ...): a flag renamed, dropped or re-described
//! shows up in review as a diff of what operators read. After a deliberate change, run
//! `CONFED_UPDATE_HELP=1 cargo test -p confed --bins help` and commit the files it writes.
//! Environment values are left out (`[env: NAME]`), so the machine's environment does not matter.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::CommandFactory;

use super::Cli;

/// Every command's help, by snapshot file name.
fn rendered() -> BTreeMap<String, String> {
    fn walk(command: &mut clap::Command, path: &str, out: &mut BTreeMap<String, String>) {
        let help = command.render_long_help().to_string();
        out.insert(format!("{path}.txt"), without_env_values(&help));
        let names: Vec<String> = command
            .get_subcommands()
            .map(|c| c.get_name().to_string())
            .filter(|name| name != "help")
            .collect();
        for name in names {
            if let Some(sub) = command.find_subcommand_mut(&name) {
                walk(sub, &format!("{path}-{name}"), out);
            }
        }
    }
    let mut out = BTreeMap::new();
    let mut command = Cli::command();
    command.build();
    walk(&mut command, "confed", &mut out);
    out
}

/// `[env: NAME=value]` as `[env: NAME]`.
fn without_env_values(help: &str) -> String {
    let mut out = String::with_capacity(help.len());
    let mut rest = help;
    while let Some(at) = rest.find("[env: ") {
        let (before, from) = rest.split_at(at);
        out.push_str(before);
        let end = from.find(']').map_or(from.len(), |i| i + 1);
        let inside = &from[..end];
        match inside.find('=') {
            Some(eq) => {
                out.push_str(&inside[..eq]);
                out.push(']');
            }
            None => out.push_str(inside),
        }
        rest = &from[end..];
    }
    out.push_str(rest);
    out
}

fn snapshot_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/help")
}

#[test]
fn every_commands_help_matches_its_snapshot() {
    let rendered = rendered();
    let dir = snapshot_dir();
    if std::env::var_os("CONFED_UPDATE_HELP").is_some() {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for (name, help) in &rendered {
            std::fs::write(dir.join(name), help).unwrap();
        }
    }
    let mut stored: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    stored.sort();
    let expected: Vec<String> = rendered.keys().cloned().collect();
    assert_eq!(
        stored, expected,
        "tests/help/ has a file per command; run CONFED_UPDATE_HELP=1 cargo test -p confed --bins help"
    );
    for (name, help) in &rendered {
        let snapshot = std::fs::read_to_string(dir.join(name)).unwrap();
        assert!(
            &snapshot == help,
            "{name} differs from the command's --help; if the change is meant, run \
             CONFED_UPDATE_HELP=1 cargo test -p confed --bins help and commit tests/help/.\n\
             --- snapshot\n{snapshot}\n--- now\n{help}"
        );
    }
}

#[test]
fn environment_values_are_left_out_of_the_snapshots() {
    assert_eq!(
        without_env_values("a [env: CONFED_X=secret] b [env: CONFED_Y] c"),
        "a [env: CONFED_X] b [env: CONFED_Y] c"
    );
}
