// `rolloutcore replay JOURNAL`: works on a journal a live writer holds (secondary instance).
#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "journal/json.h"
#include "replay/replay.h"
#include "statemachine/describe.h"

namespace rc::cli {

Runner add_replay(CLI::App& app) {
  struct Opts {
    std::string path;
    bool json = false;
    bool events = false;
    std::uint64_t until = 0;
  };
  auto opts = std::make_shared<Opts>();
  app.add_option("journal", opts->path, "Journal directory")->required();
  app.add_flag("--json", opts->json, "Print the report as JSON");
  app.add_flag("--events", opts->events, "Print every record before the report");
  app.add_option("--until", opts->until, "Fold only up to this seq (inclusive)");
  return [opts]() -> int {
    journal::Options options;
    options.read_only = true;
    options.create_if_missing = false;
    auto opened = journal::Journal::Open(opts->path, options);
    if (!opened.ok()) {
      std::fprintf(stderr, "rolloutcore replay: %s\n", opened.status().ToString().c_str());
      return 2;
    }
    journal::Journal& j = **opened;
    if (opts->events) {
      Status st = j.Scan(1, opts->until, [&](const journal::Record& r) {
        if (opts->json) {
          std::printf("%s\n", journal::RecordToJson(r).dump().c_str());
        } else {
          std::printf("%8llu %s%s\n", static_cast<unsigned long long>(r.seq),
                      r.cause_seq == 0 ? "" : "  -> ", describe(r.event).c_str());
        }
        return Status::OK();
      });
      if (!st.ok()) std::fprintf(stderr, "scan stopped: %s\n", st.ToString().c_str());
    }
    auto report = replay::Replay(j, replay::ReplayOptions{opts->until});
    if (!report.ok()) {
      std::fprintf(stderr, "rolloutcore replay: %s\n", report.status().ToString().c_str());
      return 2;
    }
    if (opts->json) {
      std::printf("%s\n", replay::ReportJson(*report).c_str());
    } else {
      std::printf("%s", replay::FormatReport(*report).c_str());
    }
    return report->ok ? 0 : 1;
  };
}

}  // namespace rc::cli
