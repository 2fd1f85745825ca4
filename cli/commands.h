// Subcommands of the `rolloutcore` command. Each registers its options on the CLI11 app and
// returns the exit code of its run.
#pragma once

#include <functional>

#include <CLI/CLI.hpp>

namespace rc::cli {

using Runner = std::function<int()>;

Runner add_replay(CLI::App& app);
Runner add_demo(CLI::App& app);
Runner add_serve(CLI::App& app);
Runner add_audit(CLI::App& app);
Runner add_restore(CLI::App& app);

}  // namespace rc::cli
