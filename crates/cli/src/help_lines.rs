//! Every flag of every command has a help line, and every optional flag that takes a value
//! states what it is when not given: clap's own `[default: …]` or one in the text. Walks the
//! whole command tree, so a flag added without one fails here.

use crate::Cli;
use clap::{ArgAction, Command, CommandFactory};

/// `(command path, flag, what is missing)` for every flag of `cmd` and its subcommands.
fn missing(cmd: &Command, path: &str, out: &mut Vec<String>) {
    for arg in cmd.get_arguments() {
        let id = arg.get_long().unwrap_or(arg.get_id().as_str());
        if id == "help" || id == "version" {
            continue;
        }
        let help = arg
            .get_help()
            .or(arg.get_long_help())
            .map(|h| h.to_string())
            .unwrap_or_default();
        if help.trim().is_empty() {
            out.push(format!("{path} --{id}: no help line"));
            continue;
        }
        let takes_value = matches!(arg.get_action(), ArgAction::Set | ArgAction::Append);
        // "(required)": the command refuses to run without it (checked in code, not by clap).
        let states_default = !arg.get_default_values().is_empty()
            || help.contains("[default")
            || help.contains("(required")
            || help.contains("(instead of");
        if takes_value && !arg.is_required_set() && !arg.is_positional() && !states_default {
            out.push(format!("{path} --{id}: help does not state its default"));
        }
    }
    for sub in cmd.get_subcommands() {
        missing(sub, &format!("{path} {}", sub.get_name()), out);
    }
}

#[test]
fn every_flag_has_a_help_line_with_its_default() {
    let mut out = vec![];
    missing(&Cli::command(), "ferrotron", &mut out);
    assert!(out.is_empty(), "flags without help:\n{}", out.join("\n"));
}

#[test]
fn the_walk_finds_a_flag_without_help() {
    // The check itself: a command with one undocumented flag and one without its default.
    let cmd = Command::new("t")
        .arg(clap::Arg::new("bare").long("bare"))
        .arg(
            clap::Arg::new("vague")
                .long("vague")
                .help("Something")
                .action(ArgAction::Set),
        )
        .arg(
            clap::Arg::new("good")
                .long("good")
                .help("Something [default: 1]"),
        );
    let mut out = vec![];
    missing(&cmd, "t", &mut out);
    assert_eq!(
        out,
        [
            "t --bare: no help line",
            "t --vague: help does not state its default"
        ]
    );
}
