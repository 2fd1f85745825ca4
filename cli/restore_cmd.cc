// `rolloutcore restore`: asks a running `rolloutcore serve` to take its TAINTED engine back to a
// version committed earlier in its journal, with proof (POST /v1/restores), and prints the
// outcome. Exit 0: restored (READY); 1: refused or failed (the engine stays TAINTED), including a
// request the executor refused before it ran (4xx: not TAINTED, label never committed, ...); 2: bad
// arguments, no connection (nothing sent), not authorized, the executor busy or failed before the
// restore began, or an answer of another shape; 3: the outcome is unknown — the request was sent
// but no answer came, or the executor answered outcome_unknown (the restore may have run: rerun
// with the same --restore-id to read it).
#ifdef RC_CLI_HAVE_EFFECTS
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/number_args.h"
#include "effects/http/engine_client.h"
#include "statemachine/quote.h"
#include "statemachine/text.h"
#include "statemachine/types.h"

namespace rc::cli {
namespace {

constexpr std::uint64_t kTimeoutSMax = 86400;

// The options as typed: each read strictly once given (ReadOptions).
struct Opts {
  std::string url = "http://127.0.0.1:8080";
  std::string label;
  std::string source;
  bool adopt = false;
  std::string restore_id;
  std::string timeout_s_typed;
  // Whether each was given (an empty text is, and is refused).
  CLI::Option* url_given = nullptr;
  CLI::Option* label_given = nullptr;
  CLI::Option* source_given = nullptr;
  CLI::Option* restore_id_given = nullptr;
  CLI::Option* timeout_s_given = nullptr;
};

std::string Esc(const std::string& s) { return text::escape_line(s); }

// The option to rerun with, for the operator to copy: the id one shell word whatever it holds
// (the default id holds the label, and a label may hold `'`, `;` or `$(...)`), joined to the
// option by `=` so that an id beginning with `-` is read as its value, never as an option.
// shell_quote's result is already one printable line.
std::string RerunWith(const std::string& restore_id) {
  return "rerun with --restore-id=" + text::shell_quote(restore_id);
}

// RC_AUTH_TOKEN, as `serve` reads it; "" when unset.
std::string TokenFromEnvironment() {
  const char* t = std::getenv("RC_AUTH_TOKEN");
  return t == nullptr ? std::string() : std::string(t);
}

constexpr const char* kDefaultIdPrefix = "restore-";
constexpr std::size_t kRawAnswerShownBytesMax = 4096;  // of an answer of another shape

// The restore's idempotency key: --restore-id, else "restore-<label>" (one per label, so a rerun
// reads the same restore's outcome).
std::string RestoreId(const Opts& o) {
  return o.restore_id.empty() ? kDefaultIdPrefix + o.label : o.restore_id;
}

nlohmann::json RequestBody(const Opts& o) {
  nlohmann::json body{{"restore_id", RestoreId(o)}, {"label", o.label}};
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

// No answer: nothing was sent when no connection was made (exit 2); otherwise the restore may
// have run, and a rerun under the same id reads its outcome (exit 3).
int NoAnswer(const effects::HttpReply& reply, const std::string& restore_id) {
  if (reply.http.transport == Transport::kConnectFailed) {
    std::printf("restore: no answer from the executor (nothing was sent): %s\n",
                Esc(reply.http.error).c_str());
    return 2;
  }
  std::printf(
      "restore: no answer from the executor after the request was sent (%s): the restore may "
      "have run; %s to read its outcome\n",
      Esc(reply.http.error).c_str(), RerunWith(restore_id).c_str());
  return 3;
}

// An answer of another shape: its first bytes, escaped, and its size.
int OddAnswer(const effects::HttpReply& reply) {
  const std::string shown = text::utf8_prefix(reply.raw, kRawAnswerShownBytesMax);
  const std::string more = shown.size() < reply.raw.size()
                               ? " ... (" + std::to_string(reply.raw.size()) + " bytes)"
                               : std::string();
  std::printf("restore: HTTP %d: %s%s\n", reply.http.http_status, Esc(shown).c_str(), more.c_str());
  return 2;
}

// An error answer serve sends ({"error": {type, message}}), or false when it is not one.
bool ReadError(const nlohmann::json& b, std::string& type, std::string& message) {
  const nlohmann::json* error = nullptr;
  return b.is_object() && b.contains("error") && ReadObject(b, "error", error) &&
         error != nullptr && ReadString(*error, "type", type) &&
         ReadString(*error, "message", message);
}

// serve's error answers: outcome_unknown may have run (exit 3); a refusal of the request (4xx
// but authorization) changed nothing (exit 1); the rest (401/403, busy, fail-stopped) ran
// nothing either and is not the restore's verdict (exit 2).
int ErrorAnswer(int status, const std::string& type, const std::string& message,
                const std::string& restore_id) {
  if (type == "outcome_unknown") {
    std::printf("restore %s: outcome unknown: %s; %s to read it\n", Esc(restore_id).c_str(),
                Esc(message).c_str(), RerunWith(restore_id).c_str());
    return 3;
  }
  std::printf("restore %s: HTTP %d %s: %s\n", Esc(restore_id).c_str(), status, Esc(type).c_str(),
              Esc(message).c_str());
  const bool refused = status >= 400 && status < 500 && status != 401 && status != 403;
  return refused ? 1 : 2;
}

// One line per fact of the answer; every field came from the executor: escaped.
int Report(const effects::HttpReply& reply, const std::string& restore_id) {
  if (reply.http.transport != Transport::kOk) return NoAnswer(reply, restore_id);
  std::string type;
  std::string message;
  if (ReadError(reply.body, type, message)) {
    return ErrorAnswer(reply.http.http_status, type, message, restore_id);
  }
  Outcome o;
  if (!ReadOutcome(reply.body, o)) return OddAnswer(reply);
  std::printf("restore %s: %s\n", Esc(o.restore_id).c_str(), Esc(o.outcome).c_str());
  std::printf("reason: %s\n", Esc(o.reason).c_str());
  std::printf("lifecycle: %s\n", Esc(o.lifecycle).c_str());
  return o.outcome == "committed" ? 0 : 1;
}

// A usage error on stderr, one escaped line (it may quote the command line); exit 2, nothing sent.
int Usage(const std::string& why) {
  std::fprintf(stderr, "rolloutcore restore: %s\n", Esc(why).c_str());
  return 2;
}

// The options given, read strictly (cli/cli_util.h, cli/number_args.h): a usage error quoting
// the text typed otherwise. The timeout, in seconds, into `timeout_s` (3600 when left out).
Status ReadOptions(const Opts& o, std::uint64_t& timeout_s) {
  RC_RETURN_IF_ERROR(
      CheckTextOptions({{"--url", o.url_given, &o.url, TextKind::kUrl},
                        {"--label", o.label_given, &o.label, TextKind::kId},
                        {"--source", o.source_given, &o.source, TextKind::kText},
                        {"--restore-id", o.restore_id_given, &o.restore_id, TextKind::kId}}));
  if (o.adopt == (o.source_given->count() > 0)) {
    return Status::InvalidArgument("give --source URI, or --adopt (not both)");
  }
  if (RestoreId(o).size() > kIdBytesMax) {
    return Status::InvalidArgument("--label is " + std::to_string(o.label.size()) +
                                   " bytes: give --restore-id (the default '" + kDefaultIdPrefix +
                                   "<label>' would exceed " + std::to_string(kIdBytesMax) +
                                   " bytes)");
  }
  timeout_s = 3600;
  if (o.timeout_s_given->count() == 0) return Status::OK();
  const Result<std::uint64_t> typed =
      ParseWholeNumberOption("--timeout-s", o.timeout_s_typed, 1, kTimeoutSMax);
  if (!typed.ok()) return typed.status();
  timeout_s = *typed;
  return Status::OK();
}

int Run(const Opts& o) {
  std::uint64_t timeout_s = 0;
  if (Status read = ReadOptions(o, timeout_s); !read.ok()) return Usage(read.message());
  effects::CallOptions call;
  call.timeout_ms = timeout_s * 1000;  // at most kTimeoutSMax * 1000: no overflow
  call.bearer_token = TokenFromEnvironment();
  if (!call.bearer_token.empty() && !effects::IsBearerToken(call.bearer_token)) {
    return Usage("RC_AUTH_TOKEN is not a printable token without spaces");
  }
  effects::EngineClient client(o.url);
  return Report(client.PostJson("/v1/restores", RequestBody(o), call), RestoreId(o));
}

}  // namespace

Runner add_restore(CLI::App& app) {
  auto o = std::make_shared<Opts>();
  o->url_given = app.add_option("--url", o->url,
                                "the executor's trainer API, an http:// or https:// URL (default "
                                "http://127.0.0.1:8080)");
  o->label_given =
      app.add_option("--label", o->label, "a label committed earlier in the executor's journal")
          ->required();
  o->source_given =
      app.add_option("--source", o->source,
                     "where that version's weights are (safetensors:/path, as for an update)");
  app.add_flag("--adopt", o->adopt,
               "the engine already holds them (restarted on that checkpoint): label and prove");
  o->restore_id_given =
      app.add_option("--restore-id", o->restore_id, "idempotency key (default restore-<label>)");
  o->timeout_s_given = app.add_option("--timeout-s", o->timeout_s_typed,
                                      "how long to wait for the outcome, 1 to 86400 s (default "
                                      "3600)");
  app.footer(
      "The bearer token of mutating routes is read from RC_AUTH_TOKEN, as `serve` reads it.\n"
      "The engine serves again only if its weight digest, taken while paused, equals the one\n"
      "recorded when LABEL was served; otherwise it stays TAINTED and the reason names the\n"
      "tensors that differ.");
  return [o] { return Run(*o); };
}

}  // namespace rc::cli
#endif  // RC_CLI_HAVE_EFFECTS
