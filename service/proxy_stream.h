// The proxy's reading of engine exchanges: what it adds to a client's request so the trace gets
// token ids and logprobs, what a completion (or each streamed chunk) tells about the rollout's
// trajectory and token counts, the journal parts it becomes, and the client event a streamed
// engine chunk is turned into (the fields the proxy added removed), and what a streamed event's
// parse and a stream's buffered bytes hold of the body budget. Pure functions of the JSON, apart
// from the proxy's sockets so that tests and fuzz targets run the same code.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "service/byte_budget.h"
#include "statemachine/events.h"
#include "statemachine/status.h"

namespace rc::service {

using json = nlohmann::json;

enum class ProxyRoute : std::uint8_t { kCompletions, kChat, kGenerate };

// What the proxy asked the engine for that the client did not: the answer's copies are removed
// before the client sees them (the trace has taken them by then).
struct AddedFields {
  bool token_ids = false;  // return_token_ids (completions, chat)
  bool usage = false;      // stream_options.include_usage (streamed completions, chat)
  bool logprobs = false;   // the sampled tokens' logprobs (choices[i].logprobs)
};

// Adds to a client's request body what the trace needs and the client did not ask for: token ids
// and, on a streamed answer, the usage chunk (not on /inference/v1/generate, which always returns
// token ids); and the sampled tokens' logprobs, only the sampled token's (vLLM 0.25.1: completions
// `logprobs: 0`; chat `logprobs: true, top_logprobs: 0`; generate `sampling_params.logprobs: 0`).
// Logprobs are added only where the client's fields are absent or say "none" in the form vLLM
// reads that way (null, false, top_logprobs 0), and never with `echo: true`, which turns them
// into prompt logprobs (a full prefill); anything else the client wrote is left for the engine
// to answer. `body` is the parsed request of `route` (for generate, sampling_params is an object
// or absent).
AddedFields AddTraceFields(ProxyRoute route, bool stream, json& body);

inline constexpr std::size_t kTrajectoryEntriesMax = std::size_t{1} << 20;  // per rollout
inline constexpr std::size_t kTrajectoryChoicesMax = 1024;  // choice indexes per rollout
inline constexpr std::size_t kFinishReasonBytesMax = 64;    // a longer one is not kept
// The most choices one request may ask for: vLLM numbers a completion's choices
// prompt * n + i, so this bounds a request's prompts times its `n` (CheckRequestChoices refuses a
// request that asks for more before it is admitted). A choice index is an integer in
// [0, kRequestChoicesMax); anything else in its place is no choice the request asked for, and the
// trace is untrusted rather than filed under another index. Between kTrajectoryChoicesMax and it,
// an index is a real choice that is not kept (a cut in another choice: choice 0 is still
// journaled).
inline constexpr std::uint64_t kRequestChoicesMax = std::uint64_t{1} << 16;
static_assert(kTrajectoryChoicesMax <= kRequestChoicesMax);
// The choices a proxied request asks for, read before it is admitted, so that every index its
// answer may carry is one a trace records: `n` (on /inference/v1/generate `sampling_params.n`),
// absent, null, or an integer in 1..kRequestChoicesMax in any form vLLM's lax (pydantic) reading
// of an `int` field takes as one: 2, 2.0, "2", " +2 ", "2.00", "1_0", true (1). A value of
// another form than a JSON integer is rewritten in `body` as that JSON integer, so that the
// engine is asked for the choices the trace counts. On /v1/completions times the prompts the
// request holds (a list of strings or of token-id lists is that many prompts, a string or one
// list of token ids one, and `prompt_embeds` add theirs), since vLLM numbers choice i of prompt p
// as p * n + i. `best_of` is no field of vLLM's requests (it ignores one, and so does this).
// InvalidArgument naming the field (a 400, nothing journaled) for any other value of `n` (2.5,
// "two", 0, -1, false), or for more than kRequestChoicesMax choices in all.
[[nodiscard]] Status CheckRequestChoices(ProxyRoute route, json& body);

// Journal records one trajectory becomes, at most.
inline constexpr std::size_t kTrajectoryPartsMax =
    kTrajectoryEntriesMax / kTrajectoryTokensPerRecordMax + 1;

struct ChoiceTrace {
  std::vector<std::int64_t> token_ids;
  // One number (or null) per output token: the engine's logprob rounded to the nearest float.
  json logprobs = json::array();
  std::string finish_reason;
  bool cut = false;  // token ids or logprobs of this choice were offered and not kept
};

// Every number a trace keeps is one the journal's fields hold exactly, so the journal and the
// trajectory line record the same figures: token ids within int32, counts within uint32, and
// logprobs within float's range, kept as the journal's float holds them (the engine's double
// rounded to the nearest float: -0.1 is -0.10000000149011612 in both records, 1e-50 is 0 in
// both). An engine's number outside them cuts the trace where it stands (as a token id that is no
// integer does); one that contradicts the rest of the answer (a choice index that is no choice, a
// usage count below the token ids sent) makes it untrusted.
struct Trajectory {
  json prompt_token_ids;                        // null until seen; int32 ids only
  std::map<std::int64_t, ChoiceTrace> choices;  // indexes in [0, kRequestChoicesMax)
  std::optional<std::uint64_t> usage_prompt, usage_completion;  // as the engine sent them
  std::size_t entries = 0;  // token ids and logprobs kept, at most kTrajectoryEntriesMax
  bool truncated = false;   // more were offered than kept, anywhere
  bool prompt_cut = false;  // the prompt's token ids were offered and not kept
  // A choice came with an index that is no choice (nothing of it kept): out of range or not an
  // integer, absent beside other choices, or repeated within one document.
  bool bad_index = false;

  // Takes what one engine document (a completion, or one streamed chunk) tells: the prompt's
  // token ids, the usage, and per choice its token ids, logprobs and finish reason. Outside
  // text: anything of another shape is ignored. Within one document each choice comes once, under
  // its own index; only a document whose choices array holds exactly one element may leave the
  // index out (choice 0). A stream's chunks name an index again and again, each chunk its own
  // document.
  void Absorb(const json& doc);

  // The counts the journal's RolloutFinished and the trajectory line both record: the engine's
  // usage where it is believable (UsageBelievable), else what the kept token ids count.
  std::uint32_t prompt_count() const;
  std::uint32_t completion_count() const;
  // The usage the engine sent (if any) fits the journal's fields and counts no fewer tokens than
  // the engine sent ids for (a usage chunk counts every choice of the request).
  bool UsageBelievable() const;
  // The trace stands for the engine's answer: no choice index that is no choice, a believable
  // usage, and choice 0 among the choices if there are any (the journal's parts are choice 0's;
  // recording an empty output for a choice the engine never sent would be another trajectory).
  // An untrusted trace journals no parts, and its line says truncated.
  bool Trusted() const;
  // What the trajectory line says as "truncated": something was offered and not kept, or the
  // trace is untrusted.
  bool Truncated() const { return truncated || !Trusted(); }

 private:
  std::uint64_t prompt_ids() const;
  std::uint64_t output_ids() const;
  void TakePrompt(const json& obj);
  void TakeUsage(const json& doc);
  // `index`: the choice's index within its document, nullopt when it is no choice (bad_index).
  void TakeChoice(const json& choice, std::optional<std::int64_t> index);
  ChoiceTrace* ChoiceOf(std::int64_t index);
  void TakeTokenIds(const json& ids, ChoiceTrace& trace);
  void TakeLogprobs(const json& choice, ChoiceTrace& trace);
  bool TakeLogprob(const json& logprob, ChoiceTrace& trace);
  // Counts one more entry against kTrajectoryEntriesMax; false (and `truncated`) once it is spent.
  bool TakeEntry();
};

// Splits choice 0 of a trace into TrajectoryRecorded parts of at most
// kTrajectoryTokensPerRecordMax tokens: prompt tokens first, then output tokens with their
// logprobs (NaN where the engine reported none). None when the prompt or choice 0 was cut or the
// trace is untrusted; a cut in another choice does not keep choice 0 out of the journal.
std::vector<TrajectoryRecorded> JournalTrajectoryParts(const std::string& rollout_id,
                                                       const Trajectory& trace);

// Removes what the proxy added and the client did not ask for: token ids and usage go, each
// choice's logprobs becomes null (what vLLM answers a client that asked for none).
void StripAdded(json& doc, const AddedFields& added);

// One streamed engine chunk: absorbed into the trace, then the SSE event the client receives
// ("data: <json>\n\n"), or nullopt for the usage-only chunk the client did not ask for.
std::optional<std::string> PassChunk(Trajectory& trace, const json& chunk,
                                     const AddedFields& added);

// What one streamed engine event takes while it is absorbed, its data `data`: the tree it is
// parsed into and the copy PassChunk strips, each bounded as a request's parse is
// (ParsedBytesBound: the nodes, and the text twice, which covers the client event dumped from the
// copy and appended to the client's write buffer). 4 MiB of "[{},{},...]" is ~280 MB.
std::uint64_t StreamEventBytesBound(std::string_view data);

// ---- the body budget, and what stays outside it ----
//
// Whatever a client or an engine can make serve keep is held against body_memory_bytes_max before
// it is allocated: request bodies (from their declared length, or as their buffers grow), a
// proxied request's parse and the engine's copy of it, a pass-through's copy of the client's body
// (until sent) and the engine's answer (its declared length, or each read's room before it is
// reserved), the engine's body and its parse, the trace, a streamed event's parse past
// kStreamEventUnheldBytesMax, a stream's buffered bytes past kStreamBufferUnheldBytesMax; and
// every answer waiting on its client, from when it is made (a proxied answer) or handed to its
// connection (a trainer route's, an error answer, a stream's last bytes) until written, past
// kAnswerUnheldBytesMax (http_server.h). What the budget cannot give is refused: 503 for a
// request or an answer, 502 or an error event naming body_memory_bytes_max for a rollout's engine
// call, a cut stream for last bytes after its head. What stays outside, and its bound:
//   Per connection, at most (about 440 KiB with the default header_bytes_max, 16 KiB):
//   - its read buffer, header_bytes_max + 64 KiB (a head, chunk framing, pipelined bytes), the
//     parsed head (header_bytes_max, kHeaderFieldsMax fields), and a 4 KiB watch buffer;
//   - one answer or stream's last bytes handed over without a hold: kAnswerUnheldBytesMax;
//   - while it proxies: its engine connection's buffer (kUpstreamBufferBytesMax, 192 KiB: the
//     answer's head and the framing around each read), the stream's read buffer
//     (kUpstreamReadBytes, 64 KiB) and up to kStreamBufferUnheldBytesMax of buffered SSE bytes
//     and client events.
//   Per event loop, one at a time (each made and dropped within one synchronous step): an unheld
//   event's parse (StreamEventBytesBound of kStreamEventUnheldBytesMax, ~1.4 MB); a non-streamed
//   answer's simdjson document (kRelayAnswerBytesMax, about 15 MiB) and the client's answer
//   RelayAnswer makes of it before its hold takes it (up to about twice kRelayAnswerBytesMax);
//   the old buffer of a body growing under its hold while it is copied into the new one
//   (ReserveHeld).
//   Per blocking thread (http_threads): the answer its trainer route is making, until the route
//   returns (HttpServer::RunHandler then holds it, or refuses it), and the JSON of a file a
//   trainer names, parsed under a bound of its own (256 MiB).
// The journal's and the trajectory log's queues are bounded by their own settings.

// Events of at most this many bytes (a token's chunk is a few hundred, with top logprobs a few
// thousand) are parsed without a hold, sparing every chunk two atomic operations on the budget
// all event loops share. The bound stays global: an event's trees are made and dropped within
// one synchronous dispatch on its connection's event loop (parse, PassChunk, gone before the loop
// runs anything else), so at most one unheld event's trees live per loop, io_threads (at most
// 256) times StreamEventBytesBound of this many bytes (~1.4 MB) in all; the non-streamed path
// leaves its small answers' simdjson documents out of the budget on the same per-loop ground.
inline constexpr std::size_t kStreamEventUnheldBytesMax = std::size_t{16} << 10;

inline constexpr const char* kStreamEventOverBudget =
    "an engine stream event, parsed, would take more of serve's memory budget than is left "
    "(body_memory_bytes_max)";

// One stream's hold on the body budget (body_memory_bytes_max) for the event being parsed:
// taken before each event's parse, given back once the events of one engine read are absorbed,
// so no share outlives the synchronous dispatch that made the trees, and none waits on the client
// or the engine. All of it goes back when the hold dies.
class StreamEventHold {
 public:
  explicit StreamEventHold(ByteBudget* budget) : hold_(budget) {}

  // Before the event `data` is parsed: the previous event's share goes back (its trees are gone
  // by then) and this one's StreamEventBytesBound is held, unless the event is at most
  // kStreamEventUnheldBytesMax. False, nothing held and refused() set, when the budget cannot
  // give it: the event must not be parsed.
  [[nodiscard]] bool Take(std::string_view data);
  // Once the events taken are absorbed (their trees are gone).
  void Release() { hold_.Release(); }
  bool refused() const { return refused_; }
  std::uint64_t held() const { return hold_.held(); }

 private:
  BudgetHold hold_;
  bool refused_ = false;  // sticky: the stream ends at the first refusal
};

// What a stream buffers between its engine and its client: the SSE bytes of the event being
// received (SseState::pending, up to kSseEventBytesMax and a read) and the client events of one
// engine read (as large as its events) while their write waits on the client. A stream buffering
// at most this many bytes holds none of the body budget: a token's events are a few hundred bytes
// a read, and are spared the hold's two atomic operations on the budget all event loops share.
// Each stream's engine read buffer (kUpstreamReadBytes) is this size and unheld too, so what
// goes unheld per stream is at most doubled; past it, the hold costs two atomic operations per
// engine read of tens of KiB, never per event. The bytes are counted as allocated, so a pending
// buffer a large event left is trimmed (TrimSsePending) before they are: a token stream that once
// relayed a large event is back under this bound, holding nothing and paying no atomics.
inline constexpr std::size_t kStreamBufferUnheldBytesMax = std::size_t{64} << 10;

// The most capacity a stream's pending SSE buffer keeps while it holds under a quarter of it:
// half of kStreamBufferUnheldBytesMax, so a stream whose pending bytes are few buffers at most
// that with up to as much again of client events and stays unheld. Erasing a dispatched event
// keeps the capacity it took, so without the trim one large event (up to kSseEventBytesMax) left
// its stream holding it to the end. A stream that reads 64 KiB at a time reallocates the buffer
// about once a read, small beside the parse of the read's events.
inline constexpr std::size_t kSsePendingKeptBytesMax = kStreamBufferUnheldBytesMax / 2;

// Gives back the capacity of `pending` (SseState::pending) when it passes kSsePendingKeptBytesMax
// and holds under a quarter of it; its bytes are kept. Otherwise leaves it as it is: an event
// being received keeps the room it grows into.
void TrimSsePending(std::string& pending);

inline constexpr const char* kStreamBufferOverBudget =
    "the stream's buffered events would take more of serve's memory budget than is left "
    "(body_memory_bytes_max)";

// One stream's hold on the body budget for the bytes it buffers: set after each engine read
// (what it left pending, and the client events it made) and again once the client took those
// events, so bytes a stalled client leaves buffered stay charged until the write of them ends.
// All of it goes back when the hold dies.
class StreamBufferHold {
 public:
  explicit StreamBufferHold(ByteBudget* budget) : hold_(budget) {}

  // The stream now buffers `bytes`: held when past kStreamBufferUnheldBytesMax (nothing held, and
  // no operation on the budget, at or below it). False, holding what it held, when the budget
  // cannot give the bytes beyond that.
  [[nodiscard]] bool HoldFor(std::uint64_t bytes);
  void Release() { hold_.Release(); }  // the stream buffers nothing more
  std::uint64_t held() const { return hold_.held(); }

 private:
  BudgetHold hold_;
};

}  // namespace rc::service
