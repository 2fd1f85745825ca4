// `rolloutcore audit JOURNAL`: integrity, lifecycle history, provenance, trajectory checks.
#include <cstdio>
#include <memory>
#include <string>

#include "audit/audit.h"
#include "cli/commands.h"
#include "journal/json.h"

namespace rc::cli {

Runner add_audit(CLI::App& app) {
  struct Opts {
    std::string path;
    std::string rollout;
    std::string trajectories;
    std::string engine;
    double tolerance = 1e-3;
    bool greedy = false;
    bool json = false;
  };
  auto o = std::make_shared<Opts>();
  app.add_option("journal", o->path, "Journal directory")->required();
  app.add_option("--rollout", o->rollout, "Show the provenance of one rollout");
  app.add_option("--trajectories", o->trajectories,
                 "Trajectories JSON-lines file (written by `serve`) to cross-check");
  app.add_option("--engine", o->engine,
                 "Re-score trajectories (from --trajectories, else the journal's) of the version "
                 "this engine serves (URL)");
  app.add_option("--tolerance", o->tolerance, "Largest accepted |logprob difference|");
  app.add_flag("--greedy", o->greedy, "Trajectories were sampled greedily: require top-1 tokens");
  app.add_flag("--json", o->json, "JSON output (provenance only)");
  return [o]() -> int {
    journal::Options options;
    options.read_only = true;
    options.create_if_missing = false;
    auto opened = journal::Journal::Open(o->path, options);
    if (!opened.ok()) {
      std::fprintf(stderr, "rolloutcore audit: %s\n", opened.status().ToString().c_str());
      return 2;
    }
    journal::Journal& j = **opened;
    if (!o->rollout.empty()) {
      auto p = audit::Provenance(j, o->rollout);
      if (!p.ok()) {
        std::fprintf(stderr, "rolloutcore audit: %s\n", p.status().ToString().c_str());
        return 1;
      }
      nlohmann::json out = {
          {"rollout_id", p->rollout_id},
          {"admitted_seq", p->admitted_seq},
          {"binding", journal::EventToJson(p->binding)},
          {"finished_seq", p->finished_seq},
          {"finish", p->finish ? journal::EventToJson(*p->finish) : nlohmann::json()},
          {"version",
           {{"version", journal::WeightVersionToJson(p->version.version)},
            {"identity", journal::WeightIdentityToJson(p->version.identity)},
            {"update_id", p->version.update_id},
            {"published_seq", p->version.published_seq}}}};
      std::printf("%s\n", out.dump(o->json ? -1 : 2).c_str());
      return 0;
    }
    auto report = audit::AuditJournal(j);
    if (!report.ok()) {
      std::fprintf(stderr, "rolloutcore audit: %s\n", report.status().ToString().c_str());
      return 2;
    }
    std::printf("%s", audit::FormatReport(*report).c_str());
    bool ok = report->ok;
    std::vector<audit::Trajectory> trajectories;
    if (!o->trajectories.empty()) {
      auto ts = audit::LoadTrajectories(o->trajectories);
      if (!ts.ok()) {
        std::fprintf(stderr, "rolloutcore audit: %s\n", ts.status().ToString().c_str());
        return 2;
      }
      auto failures = audit::CrossCheckTrajectories(j, *ts);
      std::printf("trajectories file: %zu, binding mismatches: %zu\n", ts->size(),
                  failures.size());
      for (const auto& f : failures) std::printf("  MISMATCH: %s\n", f.c_str());
      ok = ok && failures.empty();
      trajectories = std::move(ts.value());
    } else if (!o->engine.empty()) {
      auto ts = audit::TrajectoriesFromJournal(j);
      if (!ts.ok()) {
        std::fprintf(stderr, "rolloutcore audit: %s\n", ts.status().ToString().c_str());
        return 2;
      }
      std::printf("trajectories in the journal: %zu\n", ts->size());
      trajectories = std::move(ts.value());
    }
    if (!o->engine.empty()) {
      effects::EngineClient engine(o->engine);
      std::size_t checked = 0, bad = 0;
      for (const auto& t : trajectories) {
        audit::ReverifyResult r = audit::Reverify(engine, t, o->tolerance, o->greedy);
        if (!r.checked) continue;
        checked++;
        if (!r.ok) {
          bad++;
          std::printf("  REVERIFY FAILED %s: %s\n", r.rollout_id.c_str(), r.detail.c_str());
        }
      }
      std::printf("re-verified against %s: %zu trajectories checked, %zu failed\n",
                  o->engine.c_str(), checked, bad);
      ok = ok && bad == 0;
    }
    return ok ? 0 : 1;
  };
}

}  // namespace rc::cli
