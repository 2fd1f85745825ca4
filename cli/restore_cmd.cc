// `rolloutcore restore`: asks a running `rolloutcore serve` to take its TAINTED engine back to a
// version committed earlier in its journal, with proof (POST /v1/restores), and prints the
// outcome. Exit 0: restored (READY); 1: refused or failed (the engine stays TAINTED); 2: bad
// arguments or no answer.
#ifdef RC_CLI_HAVE_EFFECTS
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "effects/http/engine_client.h"
#include "statemachine/text.h"

namespace rc::cli {
namespace {

struct Opts {
  std::string url = "http://127.0.0.1:8080";
  std::string label;
  std::string source;
  bool adopt = false;
  std::string restore_id;
  std::uint64_t timeout_s = 3600;
};

std::string Esc(const std::string& s) { return text::escape_line(s); }

// RC_AUTH_TOKEN, as `serve` reads it; "" when unset.
std::string TokenFromEnvironment() {
  const char* t = std::getenv("RC_AUTH_TOKEN");
  return t == nullptr ? std::string() : std::string(t);
}

nlohmann::json RequestBody(const Opts& o) {
  nlohmann::json body{{"restore_id", o.restore_id.empty() ? "restore-" + o.label : o.restore_id},
                      {"label", o.label}};
  if (o.adopt) {
    body["adopt"] = true;
  } else {
    body["source"] = o.source;
  }
  return body;
}

// What an answer says, read with its types checked: the executor's answer is outside input.
struct Outcome {
  std::string restore_id;
  std::string outcome;
  std::string reason;
  std::string lifecycle = "?";
};

// False when the answer is not the shape `serve` sends (no outcome, or a field of another type).
bool ReadOutcome(const nlohmann::json& b, Outcome& out) {
  static const nlohmann::json kNoState = nlohmann::json::object();
  const nlohmann::json* state = &kNoState;
  return b.is_object() && b.contains("outcome") && ReadString(b, "outcome", out.outcome) &&
         ReadString(b, "restore_id", out.restore_id) && ReadString(b, "reason", out.reason) &&
         ReadObject(b, "state", state) && ReadString(*state, "lifecycle", out.lifecycle);
}

// One line per fact of the answer; every field came from the executor: escaped.
int Report(const effects::HttpReply& reply) {
  if (reply.http.transport != Transport::kOk) {
    std::printf("restore: no answer from the executor: %s\n", Esc(reply.http.error).c_str());
    return 2;
  }
  Outcome o;
  if (!ReadOutcome(reply.body, o)) {
    std::printf("restore: HTTP %d: %s\n", reply.http.http_status, Esc(reply.raw).c_str());
    return 2;
  }
  std::printf("restore %s: %s\n", Esc(o.restore_id).c_str(), Esc(o.outcome).c_str());
  std::printf("reason: %s\n", Esc(o.reason).c_str());
  std::printf("lifecycle: %s\n", Esc(o.lifecycle).c_str());
  return o.outcome == "committed" ? 0 : 1;
}

int Run(const Opts& o) {
  if (o.adopt == !o.source.empty()) {
    std::fprintf(stderr, "restore: give --source URI, or --adopt (not both)\n");
    return 2;
  }
  effects::CallOptions call;
  call.timeout_ms = o.timeout_s * 1000;
  call.bearer_token = TokenFromEnvironment();
  if (!call.bearer_token.empty() && !effects::IsBearerToken(call.bearer_token)) {
    std::fprintf(stderr, "restore: RC_AUTH_TOKEN is not a printable token without spaces\n");
    return 2;
  }
  effects::EngineClient client(o.url);
  return Report(client.PostJson("/v1/restores", RequestBody(o), call));
}

}  // namespace

Runner add_restore(CLI::App& app) {
  auto o = std::make_shared<Opts>();
  app.add_option("--url", o->url, "the executor's trainer API (default http://127.0.0.1:8080)");
  app.add_option("--label", o->label, "a label committed earlier in the executor's journal")
      ->required();
  app.add_option("--source", o->source,
                 "where that version's weights are (safetensors:/path, as for an update)");
  app.add_flag("--adopt", o->adopt,
               "the engine already holds them (restarted on that checkpoint): label and prove");
  app.add_option("--restore-id", o->restore_id, "idempotency key (default restore-<label>)");
  app.add_option("--timeout-s", o->timeout_s, "how long to wait for the outcome (default 3600)")
      ->check(CLI::Range(1, 86400));
  app.footer(
      "The bearer token of mutating routes is read from RC_AUTH_TOKEN, as `serve` reads it.\n"
      "The engine serves again only if its weight digest, taken while paused, equals the one\n"
      "recorded when LABEL was served; otherwise it stays TAINTED and the reason names the\n"
      "tensors that differ.");
  return [o] { return Run(*o); };
}

}  // namespace rc::cli
#endif  // RC_CLI_HAVE_EFFECTS
