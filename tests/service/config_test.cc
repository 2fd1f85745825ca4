// The configuration table (service/config.cc) against its committed reference, its example file,
// its parser, its bounds and the `rolloutcore serve` flags it drives.
#include <fcntl.h>
#include <sys/stat.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "service/config.h"
#include "statemachine/events.h"
#include "statemachine/text.h"
#include "tests/service/serve_process.h"

namespace rc::service {
namespace {

namespace fs = std::filesystem;

const fs::path kSource = RC_TEST_SOURCE_DIR;

std::string ReadAll(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

fs::path FreshDir(const std::string& tag) {
  char tmpl[] = "/tmp/rc_config_test_XXXXXX";
  const char* made = ::mkdtemp(tmpl);
  EXPECT_NE(made, nullptr);
  const fs::path dir = fs::path(made == nullptr ? "/tmp" : made) / tag;
  fs::create_directories(dir);
  return dir;
}

ServeConfig Minimal() {
  ServeConfig c;
  c.engine_url = "http://127.0.0.1:8000";
  c.journal_path = "/tmp/journal";
  return c;
}

// A value for `k` other than its default and inside its bounds.
nlohmann::json OtherValue(const ConfigKey& k) {
  const nlohmann::json d = ConfigDefault(k);
  if (d.is_boolean()) return !d.get<bool>();
  if (d.is_string()) {
    if (!k.choices.empty()) return d.get<std::string>() == "http" ? "nccl" : "http";
    if (k.key == "engine_url") return "http://10.0.0.1:8000";
    if (k.key == "rendezvous") return "10.0.0.7:29500";
    return d.get<std::string>() + "x";
  }
  if (d.is_number_unsigned() && d.get<std::uint64_t>() < k.max) return d.get<std::uint64_t>() + 1;
  if (d.is_number_integer() && d.get<std::int64_t>() > k.min) return d.get<std::int64_t>() - 1;
  return d.get<std::int64_t>() + 1;
}

// Proves docs/config.md is exactly the generated reference; it would catch a table change (a new
// key, a changed default or bound) committed without regenerating the documentation.
TEST(ConfigReference, CommittedReferenceMatchesTheTable) {
  const std::string committed = ReadAll(kSource / "docs" / "config.md");
  EXPECT_EQ(committed, ConfigReferenceMarkdown())
      << "regenerate: rolloutcore serve --config-reference > docs/config.md";
}

// Proves the example file holds every documented key once, parses, and validates; it would
// catch an example that drifts from the table or uses a key the parser rejects.
TEST(ConfigReference, ExampleSetsEveryDocumentedKeyAndValidates) {
  const fs::path example = kSource / "docs" / "serve.example.json";
  ServeConfig c;
  const Status merged = MergeConfigFile(example.string(), c);
  ASSERT_TRUE(merged.ok()) << merged.ToString();
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c).ToString();
  const auto doc = nlohmann::json::parse(ReadAll(example), nullptr, false);
  ASSERT_TRUE(doc.is_object());
  std::set<std::string> in_example;
  for (const auto& [key, value] : doc.items()) in_example.insert(key);
  std::set<std::string> documented;
  for (const auto& k : ConfigKeys()) documented.insert(std::string(k.key));
  EXPECT_EQ(in_example, documented);
}

// Proves every key, flag and member is bound exactly once and that setting one key changes only
// that key; it would catch a row that sets another member, a key the parser forgets (as
// journal_commit_stall_timeout_ms once was), or two rows sharing a key or a flag.
TEST(ConfigTable, EveryKeySetsItsOwnMemberOnly) {
  std::set<std::string_view> keys, flags;
  for (const auto& k : ConfigKeys()) {
    EXPECT_TRUE(keys.insert(k.key).second) << k.key;
    EXPECT_TRUE(flags.insert(k.flag).second) << k.flag;
    ServeConfig c = Minimal();
    const nlohmann::json before = ConfigToJson(c);
    const Status st = MergeConfigJson(nlohmann::json{{std::string(k.key), OtherValue(k)}}, c);
    ASSERT_TRUE(st.ok()) << k.key << ": " << st.ToString();
    const nlohmann::json after = ConfigToJson(c);
    for (const auto& [key, value] : before.items()) {
      if (key == k.key) {
        EXPECT_NE(after[key], value) << key << " did not change";
      } else {
        EXPECT_EQ(after[key], value) << "setting " << k.key << " changed " << key;
      }
    }
  }
  EXPECT_EQ(ConfigToJson(Minimal()).size(), ConfigKeys().size());
}

// Proves the defaults satisfy their own bounds and a just-out-of-bounds value is refused with a
// message naming the key; it would catch a default outside its bounds or a bound not enforced.
TEST(ConfigTable, BoundsAreEnforcedAndNamed) {
  ASSERT_TRUE(ValidateConfig(Minimal()).ok()) << ValidateConfig(Minimal()).ToString();
  for (const auto& k : ConfigKeys()) {
    const nlohmann::json d = ConfigDefault(k);
    std::vector<nlohmann::json> bad;
    if (d.is_string()) {
      bad.emplace_back(std::string(k.max + 1, 'a'));
      if (k.min > 0) bad.emplace_back("");
    } else if (d.is_number()) {
      if (k.min > 0) bad.emplace_back(k.min - 1);
      if (k.min < 0 && d.is_number_integer()) bad.emplace_back(k.min - 1);
      if (k.max < std::uint64_t{1} << 62) bad.emplace_back(k.max + 1);
    }
    for (const auto& v : bad) {
      ServeConfig c = Minimal();
      if (!MergeConfigJson(nlohmann::json{{std::string(k.key), v}}, c).ok()) continue;  // type
      const Status st = ValidateConfig(c);
      EXPECT_FALSE(st.ok()) << k.key << " accepted " << v.dump().substr(0, 40);
      EXPECT_NE(st.message().find(std::string(k.key)), std::string::npos) << st.ToString();
    }
  }
}

// Proves an executor_id that begins with the stalled-plan retry's reserved prefix is refused
// naming the key and the prefix, while one that only contains it later is accepted; it would
// catch an executor whose every restart replay reads as a stalled plan tried again.
TEST(ConfigTable, ExecutorIdMustNotBeginWithTheRetryPrefix) {
  ServeConfig c = Minimal();
  c.executor_id = std::string(kStalledPlanRetryPrefix) + "exec-1";
  const Status st = ValidateConfig(c);
  ASSERT_FALSE(st.ok()) << c.executor_id << " was accepted";
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("executor_id"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find(kStalledPlanRetryPrefix), std::string::npos) << st.ToString();
  c.executor_id = "exec-1/" + std::string(kStalledPlanRetryPrefix);
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c).ToString();
}

// Proves initial_label may not be the label every fresh engine reports; catches a configuration
// under which an engine restarted with its initial weights matches the committed label, so the
// monitor, the re-check and the sleeping engine's watch would all take it for the verified one.
TEST(ConfigTable, InitialLabelMustNotBeTheFreshEnginesLabel) {
  ServeConfig c = Minimal();
  c.initial_label = kFreshEngineLabel;
  const Status st = ValidateConfig(c);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("initial_label"), std::string::npos) << st.ToString();
  c.initial_label = "rc-0";
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c).ToString();
}

// Proves the memory budget for bodies must hold twice one whole request body (what a chunked
// body's buffer may reserve); it would catch a configuration under which the largest request
// allowed is always answered 503.
TEST(ConfigTable, BodyMemoryMustHoldOneBody) {
  ServeConfig c = Minimal();
  c.body_bytes_max = std::size_t{64} << 20;
  c.body_memory_bytes_max = std::uint64_t{32} << 20;
  const Status st = ValidateConfig(c);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("body_memory_bytes_max"), std::string::npos) << st.ToString();
  c.body_memory_bytes_max = (std::uint64_t{128} << 20) - 1;
  EXPECT_FALSE(ValidateConfig(c).ok());
  c.body_memory_bytes_max = std::uint64_t{128} << 20;
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c).ToString();
}

// Proves each token setting (trainer token, proxy token, engine API key) with a CR LF, a lone LF or
// a space inside is refused naming the key and never echoing the value, and that a plain token is
// accepted; it would catch a key read from a CRLF file being sent raw in `Authorization: Bearer`,
// splitting the proxied request (header injection), or a secret copied into an error message.
TEST(ConfigTable, TokensMustBeSafeInAnAuthorizationHeader) {
  for (const std::string key : {"auth_token", "proxy_token", "engine_api_key"}) {
    for (const std::string bad :
         {"secret-1\r\nX-Forged: 1", "secret-1\n", "secret 1", "secret-1\x7f", "secret-\xc3\xa9"}) {
      ServeConfig c = Minimal();
      ASSERT_TRUE(MergeConfigJson(nlohmann::json{{key, bad}}, c).ok()) << key;
      const Status st = ValidateConfig(c);
      ASSERT_FALSE(st.ok()) << key << " accepted a token with a byte a header cannot carry";
      EXPECT_EQ(st.code(), Code::kInvalidArgument);
      EXPECT_NE(st.message().find(key), std::string::npos) << st.ToString();
      EXPECT_EQ(st.message().find("secret"), std::string::npos) << "value echoed: " << key;
      EXPECT_EQ(st.message().find("Forged"), std::string::npos) << "value echoed: " << key;
    }
    ServeConfig c = Minimal();
    ASSERT_TRUE(MergeConfigJson(nlohmann::json{{key, "tok-EN_1.a~+/="}}, c).ok());
    EXPECT_TRUE(ValidateConfig(c).ok()) << key << ": " << ValidateConfig(c).ToString();
  }
}

// Proves listen_host must be an IP literal that make_address reads whole, with a %scope only on a
// link-local IPv6 address (where it is required), refused naming the key without a raw control
// byte; it would catch "localhost" failing only in Start(), after the journal was recovered, and
// "::1%\nFORGED" binding ::1 while its newline forges a line of the log.
TEST(ConfigTable, ListenHostMustBeAnIpLiteralWithoutAForgedScope) {
  const std::vector<std::string> bad = {"localhost",   "::1%\nFORGED", "::1%eth0",
                                        "127.0.0.1%1", "127.0.0.1 ",   std::string("::1\0x", 5),
                                        "10.0.0.256",  "[::1]",        "fe80::1",
                                        "fe80::1%",    "fe80::1%eth 0"};
  for (const std::string& host : bad) {
    ServeConfig c = Minimal();
    c.listen_host = host;
    const Status st = ValidateConfig(c);
    ASSERT_FALSE(st.ok()) << text::escape_line(host) << " was accepted";
    EXPECT_EQ(st.code(), Code::kInvalidArgument);
    EXPECT_NE(st.message().find("listen_host"), std::string::npos) << st.ToString();
    EXPECT_EQ(st.message().find_first_of(std::string("\n\r\0", 3)), std::string::npos)
        << text::escape_line(st.message());
  }
  for (const std::string host : {"127.0.0.1", "0.0.0.0", "::1", "::", "fe80::1%1"}) {
    ServeConfig c = Minimal();
    c.listen_host = host;
    EXPECT_TRUE(ValidateConfig(c).ok()) << host << ": " << ValidateConfig(c).ToString();
  }
}

// Proves an engine URL, of one engine or of a fleet member, is refused naming its key unless
// ParseEngineUrl reads it (port 1..65535, a well-formed host) and it is printable ASCII without
// spaces; it would catch a port 0 or 99999 or an unclosed "[::1" that failed only after the
// journal was created, and a space or CR LF that curl refused until the startup timeout or that
// the proxy copied into its Host header and request line.
TEST(ConfigTable, EngineUrlMustBeOneTheProxyAndCurlRead) {
  const std::vector<std::string> bad = {
      "http://h:0",          "http://h:99999",       "http://[::1",   "http://a b/",
      "http://h:1/\r\nX: 1", "http://h:1/p\x7f",     "http://h:",     "http://::1:8000",
      "http://[]:80",        "http://[::1%25lo]:80", "http://u@h:80", "http://"};
  for (const std::string& url : bad) {
    ServeConfig one = Minimal();
    one.engine_url = url;
    ServeConfig fleet = Minimal();
    fleet.engine_url.clear();
    fleet.engines = {{"a", url}};
    const std::vector<std::pair<ServeConfig, std::string>> configs = {
        {one, "engine_url"}, {fleet, "engines['a'].engine_url"}};
    for (const auto& [c, key] : configs) {
      const Status st = ValidateConfig(c);
      ASSERT_FALSE(st.ok()) << key << " accepted " << text::escape_line(url);
      EXPECT_EQ(st.code(), Code::kInvalidArgument);
      EXPECT_EQ(st.message().rfind(key, 0), 0U) << st.ToString();
      EXPECT_EQ(st.message().find_first_of("\n\r\x7f"), std::string::npos)
          << text::escape_line(st.message());
    }
  }
  for (const std::string url : {"http://127.0.0.1:8000", "http://[::1]:8000/v1", "http://engine-1",
                                "http://Engine_2.local:65535/prefix/"}) {
    ServeConfig c = Minimal();
    c.engine_url = url;
    EXPECT_TRUE(ValidateConfig(c).ok()) << url << ": " << ValidateConfig(c).ToString();
  }
}

// Proves an unknown key is refused with the closest valid keys (or, with none close, all of
// them) and outside bytes are not echoed raw; it would catch the bare "unknown config key" that
// left users guessing (e.g. `journal` for `journal_path`).
TEST(ConfigParse, UnknownKeyNamesTheClosestValidKeys) {
  ServeConfig c;
  Status st = MergeConfigJson(nlohmann::json{{"journal", "/x"}}, c);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("journal_path"), std::string::npos) << st.message();
  st = MergeConfigJson(nlohmann::json{{"listen_prot", 1}}, c);
  EXPECT_NE(st.message().find("did you mean 'listen_port'"), std::string::npos) << st.message();
  st = MergeConfigJson(nlohmann::json{{"zzzzzzzz", 1}}, c);
  EXPECT_NE(st.message().find("engine_monitor_interval_ms"), std::string::npos) << st.message();
  st = MergeConfigJson(nlohmann::json{{std::string("a\nb\x01") + std::string(500, 'q'), 1}}, c);
  EXPECT_EQ(st.message().find('\n'), std::string::npos);
  EXPECT_LT(st.message().size(), 4096u);
}

// Proves wrong types, values the member cannot hold, non-JSON and oversized files are refused
// as errors (no exception, no silent truncation); it would catch 2^40 wrapping into a port.
TEST(ConfigParse, WrongTypesAndUnrepresentableValuesAreRefused) {
  ServeConfig c;
  for (const auto& doc :
       {nlohmann::json{{"listen_port", std::uint64_t{1} << 40}},
        nlohmann::json{{"listen_port", 1.5}}, nlohmann::json{{"call_timeout_ms", -1}},
        nlohmann::json{{"cuda_device", "0"}}, nlohmann::json{{"journal_sync", 1}},
        nlohmann::json{{"engine_url", 3}},
        nlohmann::json{{"retry_after_s", std::uint64_t{1} << 33}}, nlohmann::json::array()}) {
    EXPECT_FALSE(MergeConfigJson(doc, c).ok()) << doc.dump();
  }
  EXPECT_EQ(c.listen_port, ServeConfig{}.listen_port);
  const fs::path dir = FreshDir("parse");
  std::ofstream(dir / "bad.json") << "{\"listen_port\": ";
  EXPECT_FALSE(MergeConfigFile((dir / "bad.json").string(), c).ok());
  std::ofstream(dir / "big.json") << std::string(kConfigFileBytesMax + 1, ' ');
  EXPECT_FALSE(MergeConfigFile((dir / "big.json").string(), c).ok());
  EXPECT_FALSE(MergeConfigFile((dir / "missing.json").string(), c).ok());
  fs::remove_all(dir.parent_path());
}

// Proves a config file that is a FIFO (or a directory) is refused at once, naming what it is not,
// and changes nothing; catches the plain stream read that waited for ever on a FIFO with no
// writer (the test then opens the write end itself, so a regression fails instead of hanging).
TEST(ConfigParse, AConfigFileThatIsNoRegularFileIsRefusedAtOnce) {
  const fs::path dir = FreshDir("fifo");
  const fs::path fifo = dir / "config.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ServeConfig c;
  std::promise<Status> merged;
  std::future<Status> answer = merged.get_future();
  std::thread reader([&] { merged.set_value(MergeConfigFile(fifo.string(), c)); });
  const bool at_once = answer.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  if (!at_once) {
    const int unblock = ::open(fifo.c_str(), O_WRONLY);  // lets a blocked reader see end of file
    if (unblock >= 0) ::close(unblock);
  }
  reader.join();
  EXPECT_TRUE(at_once) << "the read of a FIFO blocked";
  const Status st = answer.get();
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("not a regular file"), std::string::npos) << st.ToString();
  EXPECT_EQ(c.listen_port, ServeConfig{}.listen_port);
  EXPECT_EQ(MergeConfigFile(dir.string(), c).code(), Code::kInvalidArgument);
  fs::remove_all(dir.parent_path());
}

#ifdef RC_TEST_ROLLOUTCORE_BIN
stack::ServeRun RunServe(const std::vector<std::string>& args, const fs::path& out) {
  return stack::RunServeProcess(RC_TEST_ROLLOUTCORE_BIN, args, out, std::chrono::seconds(30));
}

// Proves the CLI accepts every table flag with its default value and prints the same reference
// as the library; it would catch a row without a flag or a flag parsed as the wrong type.
TEST(ConfigCli, EveryFlagIsAcceptedAndTheReferenceIsPrinted) {
  const fs::path dir = FreshDir("cli");
  std::vector<std::string> args = {"--config-reference"};
  for (const auto& k : ConfigKeys()) {
    args.push_back("--" + std::string(k.flag));
    if (k.is_switch) continue;
    const nlohmann::json d = ConfigDefault(k);
    args.push_back(d.is_string() ? d.get<std::string>() : d.dump());
  }
  const stack::ServeRun run = RunServe(args, dir / "out.txt");
  EXPECT_EQ(run.exit_code, 0) << run.output.substr(0, 2000);
  EXPECT_EQ(run.output, ConfigReferenceMarkdown());
  fs::remove_all(dir.parent_path());
}

// Proves serve creates a missing parent of the journal directory and says so; it would catch
// the RocksDB "No such file or directory" that a first start on a fresh path used to end in.
TEST(ConfigCli, MissingJournalParentIsCreatedAndLogged) {
  const fs::path dir = FreshDir("parent");
  const fs::path journal = dir / "a" / "b" / "journal";
  const stack::ServeRun run =
      RunServe({"--engine-url", "http://127.0.0.1:1", "--journal", journal.string(), "--port", "0",
                "--initial-source", "synthetic:4x64", "--engine-startup-timeout-ms", "200"},
               dir / "out.txt");
  EXPECT_NE(run.exit_code, 0) << run.output;  // no engine answers on port 1
  EXPECT_TRUE(fs::is_directory(journal.parent_path())) << run.output;
  EXPECT_NE(run.output.find("created the journal's parent directory"), std::string::npos)
      << run.output;
  fs::remove_all(dir.parent_path());
}

// Proves serve logs its effective configuration at start on one line with every token redacted;
// it would catch a token written to the log, or a startup that leaves no record of what it ran.
TEST(ConfigCli, TheStartupLogShowsTheConfigurationWithoutItsTokens) {
  const fs::path dir = FreshDir("startup-log");
  const stack::ServeRun run =
      RunServe({"--engine-url", "http://127.0.0.1:1", "--journal", (dir / "journal").string(),
                "--port", "0", "--initial-source", "synthetic:4x64", "--engine-startup-timeout-ms",
                "200", "--auth-token", "trainer-secret-1", "--proxy-token", "client-secret-2"},
               dir / "out.txt");
  const std::size_t at = run.output.find("serve: configuration {");
  ASSERT_NE(at, std::string::npos) << run.output;
  const std::string line = run.output.substr(at, run.output.find('\n', at) - at);
  EXPECT_NE(line.find("\"auth_token\":\"<redacted>\""), std::string::npos) << line;
  EXPECT_NE(line.find("\"engine_url\":\"http://127.0.0.1:1\""), std::string::npos) << line;
  EXPECT_EQ(run.output.find("secret"), std::string::npos) << run.output;
  fs::remove_all(dir.parent_path());
}

// Proves the startup configuration line stays one line of printable ASCII when a config string
// holds U+2028, NEL, a bidi override, DEL and an ill-formed byte, each shown escaped; it would
// catch those bytes written raw into the log, where a reader splitting on U+2028 or NEL sees a
// forged second record and a terminal shows the line reordered.
TEST(ConfigCli, TheStartupLogIsOneLineOfPrintableAscii) {
  const fs::path dir = FreshDir("startup-ascii");
  const std::string executor_id =
      "exec\xe2\x80\xa8"  // U+2028
      "a\xc2\x85"         // NEL
      "b\xe2\x80\xae"     // RIGHT-TO-LEFT OVERRIDE
      "c\x7f"             // DEL
      "d\xff"             // never UTF-8
      "e";
  const stack::ServeRun run =
      RunServe({"--engine-url", "http://127.0.0.1:1", "--journal", (dir / "journal").string(),
                "--port", "0", "--initial-source", "synthetic:4x64", "--engine-startup-timeout-ms",
                "200", "--executor-id", executor_id},
               dir / "out.txt");
  const std::size_t at = run.output.find("serve: configuration {");
  ASSERT_NE(at, std::string::npos) << run.output;
  EXPECT_EQ(run.output.find("serve: configuration {", at + 1), std::string::npos) << run.output;
  const std::size_t end = run.output.find('\n', at);
  ASSERT_NE(end, std::string::npos) << run.output;
  const std::string line = run.output.substr(at, end - at);
  for (const char ch : line) {
    const auto byte = static_cast<unsigned char>(ch);
    ASSERT_TRUE(byte >= 0x20 && byte < 0x7f) << "byte " << int{byte} << " in: " << line;
  }
  EXPECT_EQ(line.back(), '}') << line;
  EXPECT_NE(line.find("\\u2028"), std::string::npos) << line;
  EXPECT_NE(line.find("\\u0085"), std::string::npos) << line;
  EXPECT_NE(line.find("\\u007f"), std::string::npos) << line;
  fs::remove_all(dir.parent_path());
}

// Proves an engine key taken from RC_ENGINE_API_KEY with a CR LF in it (a key file written on
// Windows) stops serve at start, exit 2, naming the variable without printing the key; it would
// catch the environment path bypassing the check that the flag and the file get.
TEST(ConfigCli, AnEngineKeyWithALineBreakFromTheEnvironmentIsRefused) {
  const fs::path dir = FreshDir("env-key");
  ASSERT_EQ(::setenv("RC_ENGINE_API_KEY", "engine-secret-3\r\nX-Forged: 1", 1), 0);
  const stack::ServeRun run =
      RunServe({"--engine-url", "http://127.0.0.1:1", "--journal", (dir / "journal").string(),
                "--port", "0", "--initial-source", "synthetic:4x64"},
               dir / "out.txt");
  ::unsetenv("RC_ENGINE_API_KEY");
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_NE(run.output.find("RC_ENGINE_API_KEY"), std::string::npos) << run.output;
  EXPECT_EQ(run.output.find("secret"), std::string::npos) << run.output;
  EXPECT_EQ(run.output.find("Forged"), std::string::npos) << run.output;
  fs::remove_all(dir.parent_path());
}

// Proves a listen address that is a name, and an engine URL with port 0, stop serve with exit 2
// before the journal's directory exists; it would catch either refused only by Start() or by the
// engine client, after the journal was created and recovered or bootstrapped.
TEST(ConfigCli, AnUnbindableHostOrEngineUrlStopsServeBeforeTheJournal) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"localhost", "http://127.0.0.1:1"}, {"127.0.0.1", "http://127.0.0.1:0"}};
  for (const auto& [host, url] : cases) {
    const fs::path dir = FreshDir("unbindable");
    const stack::ServeRun run =
        RunServe({"--engine-url", url, "--journal", (dir / "j" / "journal").string(), "--host",
                  host, "--port", "0", "--initial-source", "synthetic:4x64"},
                 dir / "out.txt");
    EXPECT_EQ(run.exit_code, 2) << run.output;
    const char* named = host == "localhost" ? "listen_host (--host)" : "engine_url is not";
    EXPECT_NE(run.output.find(named), std::string::npos) << run.output;
    EXPECT_FALSE(fs::exists(dir / "j")) << run.output;
    fs::remove_all(dir.parent_path());
  }
}
#endif

}  // namespace
}  // namespace rc::service
