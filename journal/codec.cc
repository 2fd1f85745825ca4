// Record and State codec. The wire grammar is in codec.h; this file is the only place that
// touches the generated FlatBuffers types.
#include "journal/codec.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "journal/events_generated.h"
#include "statemachine/hex.h"
#include "statemachine/overloaded.h"
#include "statemachine/text.h"

namespace rc::journal {
namespace {

namespace fb = ::rc::fb;
using flatbuffers::FlatBufferBuilder;
using flatbuffers::Offset;

// ---- encode ----

template <class E>
auto Fb(E e) {
  return static_cast<std::underlying_type_t<E>>(e);
}

Offset<fb::WeightVersion> EncVersion(FlatBufferBuilder& b, const WeightVersion& v) {
  auto label = b.CreateString(v.label);
  return fb::CreateWeightVersion(b, v.generation, label);
}

Offset<fb::WeightIdentity> EncIdentity(FlatBufferBuilder& b, const WeightIdentity& id) {
  auto manifest = b.CreateString(id.manifest_digest);
  auto content = b.CreateString(id.content_digest);
  auto checkpoint = b.CreateString(id.checkpoint);
  auto run = b.CreateString(id.run);
  return fb::CreateWeightIdentity(b, manifest, content, checkpoint, run, id.step);
}

Offset<fb::HttpEvidence> EncHttp(FlatBufferBuilder& b, const HttpEvidence& h) {
  auto error = b.CreateString(h.error);
  return fb::CreateHttpEvidence(b, static_cast<fb::Transport>(Fb(h.transport)), h.http_status,
                                h.body_parsed, h.latency_us, error);
}

// Fields appended after v2 are written only when set, so events that do not use them keep the
// bytes they always had.
Offset<flatbuffers::String> OptString(FlatBufferBuilder& b, const std::string& s) {
  return s.empty() ? Offset<flatbuffers::String>() : b.CreateString(s);
}

// An absent digest is written as no table at all: events without one keep their v3 bytes.
Offset<fb::WeightDigest> EncDigest(FlatBufferBuilder& b, const WeightDigest& d) {
  if (!d.present() && d.error.empty()) return {};
  std::vector<Offset<fb::TensorDigest>> tensors;
  tensors.reserve(d.tensors.size());
  for (const TensorDigest& t : d.tensors) {
    auto name = b.CreateString(t.name);
    auto digest = b.CreateString(t.digest);
    tensors.push_back(fb::CreateTensorDigest(b, name, digest));
  }
  auto tensors_vec = tensors.empty() ? Offset<flatbuffers::Vector<Offset<fb::TensorDigest>>>()
                                     : b.CreateVector(tensors);
  auto algorithm = OptString(b, d.algorithm);
  auto combined = OptString(b, d.combined);
  auto error = OptString(b, d.error);
  return fb::CreateWeightDigest(b, algorithm, combined, tensors_vec, d.bytes, error);
}

struct Encoded {
  fb::Payload type;
  Offset<void> value;
};

// The event's table, and a snapshot's pending bootstrap. Rules 0 (what a record from before they
// were recorded decodes as) write no field: such a record re-encodes to its own bytes.
Offset<fb::BootstrapRequested> EncBootstrap(FlatBufferBuilder& b, const BootstrapRequested& e) {
  auto label = b.CreateString(e.label);
  auto id = EncIdentity(b, e.identity);
  auto expected = b.CreateString(e.expected_digest);
  return fb::CreateBootstrapRequested(b, label, id, e.adopt, e.require_digest, expected,
                                      e.fold_rules);
}

// What the journal's open found is written only when recorded: a record without it keeps its
// v8 bytes.
Encoded EncRecovery(FlatBufferBuilder& b, const RecoveryStarted& e) {
  auto executor = b.CreateString(e.executor_id);
  auto torn_tail = OptString(b, e.journal_torn_tail);
  return {
      fb::Payload::RecoveryStarted,
      fb::CreateRecoveryStarted(b, executor, static_cast<fb::JournalEnding>(Fb(e.journal_ending)),
                                e.journal_bytes_unread, torn_tail)
          .Union()};
}

Encoded EncRestore(FlatBufferBuilder& b, const RestoreRequested& e) {
  auto restore_id = b.CreateString(e.restore_id);
  auto label = b.CreateString(e.label);
  auto uri = OptString(b, e.source_uri);
  return {fb::Payload::RestoreRequested,
          fb::CreateRestoreRequested(b, restore_id, label, uri, e.adopt).Union()};
}

Offset<fb::DeviceMemory> EncMemory(FlatBufferBuilder& b, const DeviceMemory& m) {
  if (!m.known) return {};
  return fb::CreateDeviceMemory(b, m.known, m.free_bytes_before, m.free_bytes_after, m.total_bytes);
}

// The event's table, and a fleet snapshot's open update's request.
Offset<fb::FleetUpdateRequested> EncFleetUpdateRequest(FlatBufferBuilder& b,
                                                       const FleetUpdateRequested& e) {
  auto update_id = b.CreateString(e.update_id);
  auto target = b.CreateString(e.target_label);
  auto id = EncIdentity(b, e.identity);
  auto uri = OptString(b, e.source_uri);
  auto expected = OptString(b, e.expected_digest);
  return fb::CreateFleetUpdateRequested(b, update_id, static_cast<fb::FleetUpdateMode>(Fb(e.mode)),
                                        e.batch_max, e.min_healthy, target, id, uri, expected,
                                        e.stall_judged_per_group);
}

Encoded EncFleetUpdate(FlatBufferBuilder& b, const FleetUpdateRequested& e) {
  return {fb::Payload::FleetUpdateRequested, EncFleetUpdateRequest(b, e).Union()};
}

// The event's table, and a fleet snapshot's policy.
Offset<fb::FleetConfigured> EncPolicy(FlatBufferBuilder& b, const FleetConfigured& c) {
  return fb::CreateFleetConfigured(b, c.staleness_max, c.min_serving);
}

Encoded EncFleetUpdateEnded(FlatBufferBuilder& b, const FleetUpdateEnded& e) {
  auto update_id = b.CreateString(e.update_id);
  auto reason = OptString(b, e.reason);
  return {
      fb::Payload::FleetUpdateEnded,
      fb::CreateFleetUpdateEnded(b, update_id, static_cast<fb::FleetOutcome>(Fb(e.outcome)),
                                 e.committed, e.refused, e.tainted, e.skipped, reason, e.stalled)
          .Union()};
}

Encoded EncSleepRequested(FlatBufferBuilder& b, const SleepRequested& e) {
  auto id = b.CreateString(e.sleep_id);
  return {fb::Payload::SleepRequested, fb::CreateSleepRequested(b, id, e.level).Union()};
}

Encoded EncWakeRequested(FlatBufferBuilder& b, const WakeRequested& e) {
  auto id = b.CreateString(e.wake_id);
  return {fb::Payload::WakeRequested, fb::CreateWakeRequested(b, id).Union()};
}

Encoded EncSleepObserved(FlatBufferBuilder& b, const SleepObserved& e) {
  auto http = EncHttp(b, e.http);
  auto memory = EncMemory(b, e.memory);
  return {fb::Payload::SleepObserved,
          fb::CreateSleepObserved(b, http, e.level, e.is_sleeping_known, e.is_sleeping, memory)
              .Union()};
}

Encoded EncWakeObserved(FlatBufferBuilder& b, const WakeObserved& e) {
  auto http = EncHttp(b, e.http);
  auto memory = EncMemory(b, e.memory);
  auto instance = OptString(b, e.engine_instance);
  return {fb::Payload::WakeObserved,
          fb::CreateWakeObserved(b, http, static_cast<fb::WakeTag>(Fb(e.tag)), e.is_paused_known,
                                 e.is_paused, memory, instance)
              .Union()};
}

Encoded EncProbed(FlatBufferBuilder& b, const EngineProbed& e) {
  auto http = EncHttp(b, e.http);
  auto version = b.CreateString(e.engine_version);
  auto label = b.CreateString(e.reported_label);
  auto instance = OptString(b, e.engine_instance);
  auto before = OptString(b, e.label_before);
  auto digest = EncDigest(b, e.digest);
  return {fb::Payload::EngineProbed,
          fb::CreateEngineProbed(b, http, version, label, e.is_paused_known, e.is_paused, instance,
                                 before, e.resumed_before, digest)
              .Union()};
}

Encoded EncMonitored(FlatBufferBuilder& b, const EngineMonitored& e) {
  auto http = EncHttp(b, e.http);
  auto label = b.CreateString(e.reported_label);
  auto instance = OptString(b, e.engine_instance);
  auto digest = EncDigest(b, e.digest);
  return {fb::Payload::EngineMonitored,
          fb::CreateEngineMonitored(b, http, label, e.is_paused_known, e.is_paused, instance,
                                    e.last_ok_wall_ms, e.updates_seen, digest)
              .Union()};
}

// The fleet's own events (statemachine/fleet.h); every other alternative is EncEvent's.
Encoded EncFleetEvent(FlatBufferBuilder& b, const Event& event) {
  return std::visit(
      Overloaded{
          [&](const FleetConfigured& e) -> Encoded {
            return {fb::Payload::FleetConfigured, EncPolicy(b, e).Union()};
          },
          [&](const EngineJoined& e) -> Encoded {
            auto engine = b.CreateString(e.engine);
            return {fb::Payload::EngineJoined, fb::CreateEngineJoined(b, engine).Union()};
          },
          [&](const EngineRemovalRequested& e) -> Encoded {
            auto engine = b.CreateString(e.engine);
            return {fb::Payload::EngineRemovalRequested,
                    fb::CreateEngineRemovalRequested(b, engine).Union()};
          },
          [&](const EngineRemoved& e) -> Encoded {
            auto engine = b.CreateString(e.engine);
            return {fb::Payload::EngineRemoved, fb::CreateEngineRemoved(b, engine).Union()};
          },
          [&](const FleetUpdateRequested& e) { return EncFleetUpdate(b, e); },
          [&](const FleetUpdateEnded& e) { return EncFleetUpdateEnded(b, e); },
          [&](const FleetUpdateCancelled& e) -> Encoded {
            auto update_id = b.CreateString(e.update_id);
            auto reason = OptString(b, e.reason);
            return {fb::Payload::FleetUpdateCancelled,
                    fb::CreateFleetUpdateCancelled(b, update_id, reason).Union()};
          },
          [&](const auto&) -> Encoded {
            RC_CHECK(false && "not a fleet event");
            return {};
          },
      },
      event);
}

Encoded EncEvent(FlatBufferBuilder& b, const Event& event) {
  return std::visit(
      Overloaded{
          [&](const BootstrapRequested& e) -> Encoded {
            return {fb::Payload::BootstrapRequested, EncBootstrap(b, e).Union()};
          },
          [&](const UpdateRequested& e) -> Encoded {
            auto update_id = b.CreateString(e.update_id);
            auto target = b.CreateString(e.target_label);
            auto id = EncIdentity(b, e.identity);
            auto uri = b.CreateString(e.source_uri);
            auto expected = OptString(b, e.expected_digest);
            return {fb::Payload::UpdateRequested,
                    fb::CreateUpdateRequested(b, update_id, target, id, uri, expected).Union()};
          },
          [&](const RestoreRequested& e) { return EncRestore(b, e); },
          [&](const RecoveryStarted& e) { return EncRecovery(b, e); },
          [&](const EffectStarted& e) -> Encoded {
            return {fb::Payload::EffectStarted,
                    fb::CreateEffectStarted(b, static_cast<fb::EffectKind>(Fb(e.kind)),
                                            static_cast<fb::CacheKind>(Fb(e.cache)), e.deadline_ms,
                                            static_cast<fb::WakeTag>(Fb(e.wake)))
                        .Union()};
          },
          [&](const EngineProbed& e) { return EncProbed(b, e); },
          [&](const EngineMonitored& e) { return EncMonitored(b, e); },
          [&](const SleepRequested& e) { return EncSleepRequested(b, e); },
          [&](const WakeRequested& e) { return EncWakeRequested(b, e); },
          [&](const SleepObserved& e) { return EncSleepObserved(b, e); },
          [&](const WakeObserved& e) { return EncWakeObserved(b, e); },
          [&](const DrainObserved& e) -> Encoded {
            auto http = EncHttp(b, e.http);
            return {fb::Payload::DrainObserved, fb::CreateDrainObserved(b, http, e.paused).Union()};
          },
          [&](const DrainTimedOut& e) -> Encoded {
            return {fb::Payload::DrainTimedOut,
                    fb::CreateDrainTimedOut(b, e.waited_ms, e.active_rollouts).Union()};
          },
          [&](const PreflightObserved& e) -> Encoded {
            auto digest = b.CreateString(e.source_manifest_digest);
            auto detail = b.CreateString(e.detail);
            return {
                fb::Payload::PreflightObserved,
                fb::CreatePreflightObserved(b, digest, e.device_ok, e.memory_ok, detail).Union()};
          },
          [&](const TransferObserved& e) -> Encoded {
            auto label = b.CreateString(e.finish_label);
            auto error = b.CreateString(e.error);
            return {fb::Payload::TransferObserved,
                    fb::CreateTransferObserved(b, e.acknowledged,
                                               static_cast<fb::MutationClass>(Fb(e.mutation)),
                                               e.bytes_sent, e.tensors_sent, e.duration_us, label,
                                               error, e.foreign_session)
                        .Union()};
          },
          [&](const CacheResetObserved& e) -> Encoded {
            auto http = EncHttp(b, e.http);
            return {fb::Payload::CacheResetObserved,
                    fb::CreateCacheResetObserved(b, static_cast<fb::CacheKind>(Fb(e.cache)), http,
                                                 e.reported_success, e.success_unreported)
                        .Union()};
          },
          [&](const ValidationObserved& e) -> Encoded {
            auto http = EncHttp(b, e.http);
            auto label = b.CreateString(e.reported_label);
            auto detail = b.CreateString(e.detail);
            auto instance = OptString(b, e.engine_instance);
            auto digest = EncDigest(b, e.digest);
            return {fb::Payload::ValidationObserved,
                    fb::CreateValidationObserved(b, http, label, e.checks_passed, detail, instance,
                                                 digest, e.is_paused_known, e.is_paused)
                        .Union()};
          },
          [&](const ResumeObserved& e) -> Encoded {
            auto http = EncHttp(b, e.http);
            auto instance = OptString(b, e.engine_instance);
            return {fb::Payload::ResumeObserved,
                    fb::CreateResumeObserved(b, http, e.is_paused_known, e.is_paused, instance,
                                             e.is_sleeping_known, e.is_sleeping)
                        .Union()};
          },
          [&](const RolloutAdmitted& e) -> Encoded {
            auto rid = b.CreateString(e.rollout_id);
            auto version = EncVersion(b, e.version);
            auto id = EncIdentity(b, e.identity);
            return {fb::Payload::RolloutAdmitted,
                    fb::CreateRolloutAdmitted(b, rid, version, id, e.lease_ms).Union()};
          },
          [&](const RolloutFinished& e) -> Encoded {
            auto rid = b.CreateString(e.rollout_id);
            return {
                fb::Payload::RolloutFinished,
                fb::CreateRolloutFinished(b, rid, static_cast<fb::RolloutOutcome>(Fb(e.outcome)),
                                          e.prompt_tokens, e.completion_tokens)
                    .Union()};
          },
          [&](const TrajectoryRecorded& e) -> Encoded {
            auto rid = b.CreateString(e.rollout_id);
            auto prompt = b.CreateVector(e.prompt_token_ids);
            auto output = b.CreateVector(e.output_token_ids);
            auto logprobs = b.CreateVector(e.output_logprobs);
            return {fb::Payload::TrajectoryRecorded,
                    fb::CreateTrajectoryRecorded(b, rid, e.part, prompt, output, logprobs).Union()};
          },
          [&](const StateChanged& e) -> Encoded {
            auto detail = b.CreateString(e.detail);
            return {fb::Payload::StateChanged,
                    fb::CreateStateChanged(b, static_cast<fb::Lifecycle>(Fb(e.from)),
                                           static_cast<fb::Lifecycle>(Fb(e.to)),
                                           static_cast<fb::Cause>(Fb(e.cause)), detail)
                        .Union()};
          },
          [&](const VersionPublished& e) -> Encoded {
            auto update_id = b.CreateString(e.update_id);
            auto version = EncVersion(b, e.version);
            auto id = EncIdentity(b, e.identity);
            auto digest = OptString(b, e.engine_digest);
            return {fb::Payload::VersionPublished,
                    fb::CreateVersionPublished(b, update_id, version, id, digest).Union()};
          },
          [&](const UpdateEnded& e) -> Encoded {
            auto update_id = b.CreateString(e.update_id);
            auto reason = b.CreateString(e.reason);
            return {fb::Payload::UpdateEnded,
                    fb::CreateUpdateEnded(b, update_id,
                                          static_cast<fb::UpdateOutcome>(Fb(e.outcome)), reason)
                        .Union()};
          },
          [&](const auto&) { return EncFleetEvent(b, event); },  // the fleet's own events
      },
      event);
}

std::string Finish(FlatBufferBuilder& b) {
  return std::string(reinterpret_cast<const char*>(b.GetBufferPointer()), b.GetSize());
}

// ---- decode ----

// Collects the first semantic error while converting a verified buffer.
struct Decoder {
  std::string error;

  template <class E, class F>
  E Enum(F raw_enum, std::uint8_t max, const char* what) {
    const auto raw = static_cast<std::uint8_t>(raw_enum);
    if (raw > max) {
      if (error.empty()) {
        error = std::string(what) + " value " + std::to_string(raw) + " out of range (max " +
                std::to_string(max) + ")";
      }
      return static_cast<E>(0);
    }
    return static_cast<E>(raw);
  }

  // Text the journal recorded from outside: at most `max` bytes of valid UTF-8, else "" and the
  // error (a reader escapes it on output; it must not hold what no writer could have written).
  std::string Text(const flatbuffers::String* s, std::size_t max, const char* what) {
    if (s == nullptr) return std::string();
    const std::string_view v(s->c_str(), s->size());
    if (v.size() <= max && text::valid_utf8(v)) return std::string(v);
    if (error.empty()) {
      error = std::string(what) + " of " + std::to_string(s->size()) +
              " bytes is over its bound of " + std::to_string(max) + " or not UTF-8";
    }
    return std::string();
  }

  // The fold rules a bootstrap recorded: at most this build's (a higher number is a journal from
  // a newer RolloutCore, whose rules this build does not know and must not fold by).
  std::uint32_t FoldRules(std::uint32_t raw, const char* what) {
    if (raw <= kFoldRulesCurrent) return raw;
    if (error.empty()) {
      error = std::string(what) + " " + std::to_string(raw) +
              ": written by a newer RolloutCore (this one folds by rules up to " +
              std::to_string(kFoldRulesCurrent) + ")";
    }
    return 0;
  }
};

std::string Str(const flatbuffers::String* s) { return s == nullptr ? std::string() : s->str(); }

// Stored text in an error message, quoted: escaped onto one line (it may be anything a writer
// hashed) and cut near kIdBytesMax.
std::string Quote(const std::string& s) {
  std::string escaped = text::escape_line(s);
  if (escaped.size() > kIdBytesMax) {
    escaped = text::utf8_prefix(std::move(escaped), kIdBytesMax) + "...";
  }
  return "'" + escaped + "'";
}

WeightVersion DecVersion(const fb::WeightVersion* v) {
  if (v == nullptr) return {};
  return WeightVersion{v->generation(), Str(v->label())};
}

WeightIdentity DecIdentity(const fb::WeightIdentity* v) {
  if (v == nullptr) return {};
  return WeightIdentity{Str(v->manifest_digest()), Str(v->content_digest()), Str(v->checkpoint()),
                        Str(v->run()), v->step()};
}

WeightDigest DecDigest(const fb::WeightDigest* v) {
  if (v == nullptr) return {};
  WeightDigest d;
  d.algorithm = Str(v->algorithm());
  d.combined = Str(v->combined());
  d.bytes = v->bytes();
  d.error = Str(v->error());
  if (v->tensors() == nullptr) return d;
  d.tensors.reserve(v->tensors()->size());
  for (const fb::TensorDigest* t : *v->tensors()) {
    if (t != nullptr) d.tensors.push_back(TensorDigest{Str(t->name()), Str(t->digest())});
  }
  return d;
}

HttpEvidence DecHttp(Decoder& d, const fb::HttpEvidence* v) {
  if (v == nullptr) return {};
  HttpEvidence h;
  h.transport = d.Enum<Transport>(v->transport(), 3, "http.transport");
  h.http_status = v->http_status();
  h.body_parsed = v->body_parsed();
  h.latency_us = v->latency_us();
  h.error = Str(v->error());
  return h;
}

// Unknown memory decodes as the default value whatever figures a record carries beside it, so a
// decoded event encodes back to the same bytes' meaning (EncMemory writes nothing for it).
DeviceMemory DecMemory(const fb::DeviceMemory* v) {
  if (v == nullptr || !v->known()) return {};
  return DeviceMemory{v->known(), v->free_bytes_before(), v->free_bytes_after(), v->total_bytes()};
}

// A RecoveryStarted of v8 or before decodes as kNotRecorded: it claims nothing about the open.
RecoveryStarted DecRecovery(Decoder& d, const fb::RecoveryStarted* e) {
  RecoveryStarted out{Str(e->executor_id())};
  out.journal_ending = d.Enum<JournalEnding>(e->journal_ending(), kJournalEndingMax,
                                             "RecoveryStarted.journal_ending");
  out.journal_bytes_unread = e->journal_bytes_unread();
  out.journal_torn_tail =
      d.Text(e->journal_torn_tail(), kTextBytesMax, "RecoveryStarted.journal_torn_tail");
  return out;
}

// A union member appended to the schema must be known to the decoder too.
static_assert(kPayloadTagMax == static_cast<std::uint8_t>(fb::Payload::MAX));

constexpr std::uint8_t kEffectKindMaxRaw = kEffectKindMax;
constexpr std::uint8_t kCacheMaxRaw = kCacheKinds - 1;

// Bindings and decisions; `r`'s payload is one of them.
Event DecOutcomeEvent(Decoder& d, const fb::Record* r) {
  switch (r->payload_type()) {
    case fb::Payload::RolloutAdmitted: {
      auto* e = r->payload_as_RolloutAdmitted();
      return RolloutAdmitted{Str(e->rollout_id()), DecVersion(e->version()),
                             DecIdentity(e->identity()), e->lease_ms()};
    }
    case fb::Payload::RolloutFinished: {
      auto* e = r->payload_as_RolloutFinished();
      return RolloutFinished{
          Str(e->rollout_id()),
          d.Enum<RolloutOutcome>(e->outcome(), kRolloutOutcomeMax, "RolloutFinished.outcome"),
          e->prompt_tokens(), e->completion_tokens()};
    }
    case fb::Payload::StateChanged: {
      auto* e = r->payload_as_StateChanged();
      return StateChanged{d.Enum<Lifecycle>(e->from(), kLifecycleMax, "StateChanged.from"),
                          d.Enum<Lifecycle>(e->to(), kLifecycleMax, "StateChanged.to"),
                          d.Enum<Cause>(e->cause(), kCauseMax, "StateChanged.cause"),
                          Str(e->detail())};
    }
    case fb::Payload::VersionPublished: {
      auto* e = r->payload_as_VersionPublished();
      return VersionPublished{Str(e->update_id()), DecVersion(e->version()),
                              DecIdentity(e->identity()), Str(e->engine_digest())};
    }
    case fb::Payload::UpdateEnded: {
      auto* e = r->payload_as_UpdateEnded();
      return UpdateEnded{Str(e->update_id()),
                         d.Enum<UpdateOutcome>(e->outcome(), 2, "UpdateEnded.outcome"),
                         Str(e->reason())};
    }
    case fb::Payload::TrajectoryRecorded: {
      auto* e = r->payload_as_TrajectoryRecorded();
      TrajectoryRecorded t;
      t.rollout_id = Str(e->rollout_id());
      t.part = e->part();
      if (e->prompt_token_ids()) {
        t.prompt_token_ids.assign(e->prompt_token_ids()->begin(), e->prompt_token_ids()->end());
      }
      if (e->output_token_ids()) {
        t.output_token_ids.assign(e->output_token_ids()->begin(), e->output_token_ids()->end());
      }
      if (e->output_logprobs()) {
        t.output_logprobs.assign(e->output_logprobs()->begin(), e->output_logprobs()->end());
      }
      return t;
    }
    default:
      break;
  }
  RC_CHECK(false && "not a binding or decision");
  return Event{};
}

// The event's table, and a fleet snapshot's open update's request; `e` is non-null.
FleetUpdateRequested DecFleetUpdateRequest(Decoder& d, const fb::FleetUpdateRequested* e) {
  return FleetUpdateRequested{
      Str(e->update_id()),
      d.Enum<FleetUpdateMode>(e->mode(), kFleetUpdateModeMax, "FleetUpdateRequested.mode"),
      e->batch_max(),
      e->min_healthy(),
      Str(e->target_label()),
      DecIdentity(e->identity()),
      Str(e->source_uri()),
      Str(e->expected_digest()),
      e->stall_judged_per_group()};
}

// The fleet's own events (statemachine/fleet.h); `r`'s payload is one of them.
Event DecFleetEvent(Decoder& d, const fb::Record* r) {
  switch (r->payload_type()) {
    case fb::Payload::FleetConfigured: {
      auto* e = r->payload_as_FleetConfigured();
      return FleetConfigured{e->staleness_max(), e->min_serving()};
    }
    case fb::Payload::EngineJoined:
      return EngineJoined{Str(r->payload_as_EngineJoined()->engine())};
    case fb::Payload::EngineRemovalRequested:
      return EngineRemovalRequested{Str(r->payload_as_EngineRemovalRequested()->engine())};
    case fb::Payload::EngineRemoved:
      return EngineRemoved{Str(r->payload_as_EngineRemoved()->engine())};
    case fb::Payload::FleetUpdateRequested:
      return DecFleetUpdateRequest(d, r->payload_as_FleetUpdateRequested());
    case fb::Payload::FleetUpdateEnded: {
      auto* e = r->payload_as_FleetUpdateEnded();
      return FleetUpdateEnded{
          Str(e->update_id()),
          d.Enum<FleetOutcome>(e->outcome(), kFleetOutcomeMax, "FleetUpdateEnded.outcome"),
          e->committed(),
          e->refused(),
          e->tainted(),
          e->skipped(),
          Str(e->reason()),
          e->stalled()};
    }
    case fb::Payload::FleetUpdateCancelled: {
      auto* e = r->payload_as_FleetUpdateCancelled();
      return FleetUpdateCancelled{Str(e->update_id()), Str(e->reason())};
    }
    default:
      break;
  }
  RC_CHECK(false && "not a fleet event");
  return Event{};
}

// The event's table, and a snapshot's pending bootstrap (`what` names where, for the error).
BootstrapRequested DecBootstrap(Decoder& d, const fb::BootstrapRequested* e, const char* what) {
  BootstrapRequested out{Str(e->label()), DecIdentity(e->identity()), e->adopt(),
                         e->require_digest(), Str(e->expected_digest())};
  out.fold_rules = d.FoldRules(e->fold_rules(), what);
  return out;
}

// Converts a verified payload; `table` is non-null (checked by the caller).
Event DecEvent(Decoder& d, const fb::Record* r) {
  switch (r->payload_type()) {
    case fb::Payload::BootstrapRequested:
      return DecBootstrap(d, r->payload_as_BootstrapRequested(), "BootstrapRequested.fold_rules");
    case fb::Payload::UpdateRequested: {
      auto* e = r->payload_as_UpdateRequested();
      return UpdateRequested{Str(e->update_id()), Str(e->target_label()),
                             DecIdentity(e->identity()), Str(e->source_uri()),
                             Str(e->expected_digest())};
    }
    case fb::Payload::RestoreRequested: {
      auto* e = r->payload_as_RestoreRequested();
      return RestoreRequested{Str(e->restore_id()), Str(e->label()), Str(e->source_uri()),
                              e->adopt()};
    }
    case fb::Payload::RecoveryStarted:
      return DecRecovery(d, r->payload_as_RecoveryStarted());
    case fb::Payload::EffectStarted: {
      auto* e = r->payload_as_EffectStarted();
      return EffectStarted{d.Enum<EffectKind>(e->kind(), kEffectKindMaxRaw, "EffectStarted.kind"),
                           d.Enum<CacheKind>(e->cache(), kCacheMaxRaw, "EffectStarted.cache"),
                           e->deadline_ms(),
                           d.Enum<WakeTag>(e->wake(), kWakeTagMax, "EffectStarted.wake")};
    }
    case fb::Payload::SleepRequested: {
      auto* e = r->payload_as_SleepRequested();
      return SleepRequested{Str(e->sleep_id()), e->level()};
    }
    case fb::Payload::WakeRequested:
      return WakeRequested{Str(r->payload_as_WakeRequested()->wake_id())};
    case fb::Payload::SleepObserved: {
      auto* e = r->payload_as_SleepObserved();
      return SleepObserved{DecHttp(d, e->http()), e->level(), e->is_sleeping_known(),
                           e->is_sleeping(), DecMemory(e->memory())};
    }
    case fb::Payload::WakeObserved: {
      auto* e = r->payload_as_WakeObserved();
      return WakeObserved{
          DecHttp(d, e->http()),  d.Enum<WakeTag>(e->tag(), kWakeTagMax, "WakeObserved.tag"),
          e->is_paused_known(),   e->is_paused(),
          DecMemory(e->memory()), Str(e->engine_instance())};
    }
    case fb::Payload::EngineProbed: {
      auto* e = r->payload_as_EngineProbed();
      EngineProbed p{DecHttp(d, e->http()), Str(e->engine_version()), Str(e->reported_label())};
      p.is_paused_known = e->is_paused_known();
      p.is_paused = e->is_paused();
      p.engine_instance = Str(e->engine_instance());
      p.label_before = Str(e->label_before());
      p.resumed_before = e->resumed_before();
      p.digest = DecDigest(e->digest());
      return p;
    }
    case fb::Payload::EngineMonitored: {
      auto* e = r->payload_as_EngineMonitored();
      return EngineMonitored{DecHttp(d, e->http()), Str(e->reported_label()),  e->is_paused_known(),
                             e->is_paused(),        Str(e->engine_instance()), e->last_ok_wall_ms(),
                             e->updates_seen(),     DecDigest(e->digest())};
    }
    case fb::Payload::DrainObserved: {
      auto* e = r->payload_as_DrainObserved();
      return DrainObserved{DecHttp(d, e->http()), e->paused()};
    }
    case fb::Payload::DrainTimedOut: {
      auto* e = r->payload_as_DrainTimedOut();
      return DrainTimedOut{e->waited_ms(), e->active_rollouts()};
    }
    case fb::Payload::PreflightObserved: {
      auto* e = r->payload_as_PreflightObserved();
      return PreflightObserved{Str(e->source_manifest_digest()), e->device_ok(), e->memory_ok(),
                               Str(e->detail())};
    }
    case fb::Payload::TransferObserved: {
      auto* e = r->payload_as_TransferObserved();
      return TransferObserved{
          e->acknowledged(), d.Enum<MutationClass>(e->mutation(), 2, "TransferObserved.mutation"),
          e->bytes_sent(),   e->tensors_sent(),
          e->duration_us(),  Str(e->finish_label()),
          Str(e->error()),   e->foreign_session()};
    }
    case fb::Payload::CacheResetObserved: {
      auto* e = r->payload_as_CacheResetObserved();
      return CacheResetObserved{
          d.Enum<CacheKind>(e->cache(), kCacheMaxRaw, "CacheResetObserved.cache"),
          DecHttp(d, e->http()), e->reported_success(), e->success_unreported()};
    }
    case fb::Payload::ValidationObserved: {
      auto* e = r->payload_as_ValidationObserved();
      return ValidationObserved{DecHttp(d, e->http()),     Str(e->reported_label()),
                                e->checks_passed(),        Str(e->detail()),
                                Str(e->engine_instance()), DecDigest(e->digest()),
                                e->is_paused_known(),      e->is_paused()};
    }
    case fb::Payload::ResumeObserved: {
      auto* e = r->payload_as_ResumeObserved();
      return ResumeObserved{DecHttp(d, e->http()),     e->is_paused_known(),   e->is_paused(),
                            Str(e->engine_instance()), e->is_sleeping_known(), e->is_sleeping()};
    }
    case fb::Payload::RolloutAdmitted:
    case fb::Payload::RolloutFinished:
    case fb::Payload::StateChanged:
    case fb::Payload::VersionPublished:
    case fb::Payload::UpdateEnded:
    case fb::Payload::TrajectoryRecorded:
      return DecOutcomeEvent(d, r);
    case fb::Payload::FleetConfigured:
    case fb::Payload::EngineJoined:
    case fb::Payload::EngineRemovalRequested:
    case fb::Payload::EngineRemoved:
    case fb::Payload::FleetUpdateRequested:
    case fb::Payload::FleetUpdateEnded:
    case fb::Payload::FleetUpdateCancelled:
      return DecFleetEvent(d, r);
    case fb::Payload::NONE:
      break;
  }
  RC_CHECK(false && "payload tag checked by the caller");
  return Event{};
}

// FlatBuffers reads need the buffer aligned; RocksDB values have no alignment guarantee. A value
// that is already 8-byte aligned is read in place; otherwise it is copied into one per-thread
// buffer of kRecordBytesMax (allocated once, reused for every record: no allocation per decode).
class AlignedView {
 public:
  explicit AlignedView(std::string_view bytes) {
    RC_CHECK(bytes.size() <= kRecordBytesMax);
    if (reinterpret_cast<std::uintptr_t>(bytes.data()) % 8 == 0) {
      data_ = reinterpret_cast<const std::uint8_t*>(bytes.data());
      return;
    }
    thread_local std::vector<std::uint64_t> words(kRecordBytesMax / 8);
    RC_CHECK(words.size() * 8 >= bytes.size());
    if (!bytes.empty()) std::memcpy(words.data(), bytes.data(), bytes.size());
    data_ = reinterpret_cast<const std::uint8_t*>(words.data());
  }
  const std::uint8_t* data() const { return data_; }

 private:
  const std::uint8_t* data_ = nullptr;
};

// The snapshot paths (up to kStateBytesMax, a fleet's up to kFleetStateBytesMax) keep their own
// copy.
struct AlignedCopy {
  std::vector<std::uint64_t> words;
  const std::uint8_t* data() const { return reinterpret_cast<const std::uint8_t*>(words.data()); }
  explicit AlignedCopy(std::string_view bytes) : words((bytes.size() + 7) / 8) {
    RC_CHECK(bytes.size() <= kFleetStateBytesMax);  // the callers' bounds (and the compiler's)
    if (!bytes.empty()) std::memcpy(words.data(), bytes.data(), bytes.size());
  }
};

}  // namespace

std::string HashHex(const Hash& hash) { return hex::encode(hash); }

std::string EncodeRecord(const Record& record) {
  FlatBufferBuilder b(512);
  Encoded payload = EncEvent(b, record.event);
  auto prev = b.CreateVector(record.prev_hash.data(), record.prev_hash.size());
  auto engine = OptString(b, record.engine);  // absent for one engine: its records keep v6 bytes
  auto root = fb::CreateRecord(b, record.seq, record.wall_time_ms, record.cause_seq, prev,
                               payload.type, payload.value, engine);
  fb::FinishSizePrefixedRecordBuffer(b, root);
  return Finish(b);
}

std::string EncodeEventOnly(const Event& event) {
  Record r;
  r.event = event;
  return EncodeRecord(r);
}

namespace {
Result<Record> DecodeRecordImpl(std::string_view bytes, const Hash* bytes_sha256);
}  // namespace

Result<Record> DecodeRecord(std::string_view bytes) { return DecodeRecordImpl(bytes, nullptr); }
Result<Record> DecodeRecord(std::string_view bytes, const Hash& bytes_sha256) {
  return DecodeRecordImpl(bytes, &bytes_sha256);
}

namespace {
Result<Record> DecodeRecordImpl(std::string_view bytes, const Hash* bytes_sha256) {
  // The length is checked before the Verifier is built (its constructor asserts on huge sizes).
  if (bytes.size() > kRecordBytesMax) {
    return Status::Corruption("record of " + std::to_string(bytes.size()) +
                              " bytes exceeds the bound of " + std::to_string(kRecordBytesMax));
  }
  if (bytes.size() < 12) {
    return Status::Corruption("record truncated: " + std::to_string(bytes.size()) + " bytes");
  }
  AlignedView copy(bytes);
  if (!fb::SizePrefixedRecordBufferHasIdentifier(copy.data())) {
    return Status::Corruption("record lacks the file identifier RCJ1 (got '" +
                              std::string(bytes.substr(8, 4)) + "')");
  }
  flatbuffers::Verifier::Options options;
  options.max_depth = kVerifierDepthMax;
  options.max_tables = kVerifierTablesMax;
  flatbuffers::Verifier verifier(copy.data(), bytes.size(), options);
  if (!fb::VerifySizePrefixedRecordBuffer(verifier)) {
    return Status::Corruption("record fails FlatBuffers verification (" +
                              std::to_string(bytes.size()) + " bytes)");
  }
  const fb::Record* r = fb::GetSizePrefixedRecord(copy.data());
  const auto tag = static_cast<std::uint8_t>(r->payload_type());
  // The generated verifier accepts unknown union members: reject them here, explicitly.
  if (tag == 0 || tag > kPayloadTagMax) {
    return Status::Corruption("record has unknown event type " + std::to_string(tag) +
                              " (known: 1.." + std::to_string(kPayloadTagMax) + ")");
  }
  if (r->payload() == nullptr) return Status::Corruption("record has a type but no payload");
  if (r->prev_hash() == nullptr || r->prev_hash()->size() != 32) {
    return Status::Corruption("record prev_hash is not 32 bytes");
  }
  Record out;
  out.seq = r->seq();
  out.wall_time_ms = r->wall_time_ms();
  out.cause_seq = r->cause_seq();
  std::memcpy(out.prev_hash.data(), r->prev_hash()->data(), 32);
  out.engine = Str(r->engine());
  Decoder d;
  out.event = DecEvent(d, r);
  if (!d.error.empty()) {
    return Status::Corruption("record seq " + std::to_string(out.seq) + ": " + d.error);
  }
  out.hash = bytes_sha256 != nullptr ? *bytes_sha256 : Sha256(bytes);
  return out;
}
}  // namespace

// ---- State ----

namespace {

using LabelIdentities = flatbuffers::Vector<Offset<fb::LabelIdentity>>;

// An engine's label registry, and a fleet's (sorted by label, as the map is).
Offset<LabelIdentities> EncLabels(FlatBufferBuilder& b,
                                  const std::map<std::string, WeightIdentity>& labels) {
  std::vector<Offset<fb::LabelIdentity>> out;
  out.reserve(labels.size());
  for (const auto& [label, identity] : labels) {
    auto l = b.CreateString(label);
    auto id = EncIdentity(b, identity);
    out.push_back(fb::CreateLabelIdentity(b, l, id));
  }
  return b.CreateVector(out);
}

// Labels into `out`; a label named twice is the decoder's error.
void DecLabelMap(Decoder& d, const LabelIdentities* labels,
                 std::map<std::string, WeightIdentity>& out) {
  if (labels == nullptr) return;
  for (const fb::LabelIdentity* l : *labels) {
    if (l == nullptr) continue;
    auto [it, inserted] = out.emplace(Str(l->label()), DecIdentity(l->identity()));
    if (!inserted && d.error.empty()) d.error = "duplicate label " + Quote(it->first);
  }
}

Offset<fb::Counters> EncCounters(FlatBufferBuilder& b, const Counters& c) {
  return fb::CreateCounters(
      b, c.events, c.rollouts_admitted, c.rollouts_completed, c.rollouts_aborted,
      c.rollouts_abandoned, c.updates_requested, c.updates_committed, c.updates_refused,
      c.recoveries, c.rollouts_expired, c.restores_requested, c.restores_committed,
      c.sleeps_requested, c.sleeps_committed, c.wakes_requested, c.wakes_committed);
}

// By name: positional initialisation silently shifted every counter when one was added.
Counters DecCounters(const fb::Counters& c) {
  Counters n;
  n.events = c.events();
  n.rollouts_admitted = c.rollouts_admitted();
  n.rollouts_completed = c.rollouts_completed();
  n.rollouts_aborted = c.rollouts_aborted();
  n.rollouts_abandoned = c.rollouts_abandoned();
  n.rollouts_expired = c.rollouts_expired();
  n.updates_requested = c.updates_requested();
  n.updates_committed = c.updates_committed();
  n.updates_refused = c.updates_refused();
  n.recoveries = c.recoveries();
  n.restores_requested = c.restores_requested();
  n.restores_committed = c.restores_committed();
  n.sleeps_requested = c.sleeps_requested();
  n.sleeps_committed = c.sleeps_committed();
  n.wakes_requested = c.wakes_requested();
  n.wakes_committed = c.wakes_committed();
  return n;
}

Offset<fb::State> EncState(FlatBufferBuilder& b, const State& s) {
  auto committed = EncVersion(b, s.committed);
  auto committed_id = EncIdentity(b, s.committed_identity);
  Offset<fb::BootstrapRequested> bootstrap;
  if (s.bootstrap) bootstrap = EncBootstrap(b, *s.bootstrap);
  Offset<fb::Effect> in_flight;
  if (s.in_flight) {
    in_flight = fb::CreateEffect(b, static_cast<fb::EffectKind>(Fb(s.in_flight->kind)),
                                 static_cast<fb::CacheKind>(Fb(s.in_flight->cache)),
                                 static_cast<fb::WakeTag>(Fb(s.in_flight->wake)));
  }
  std::vector<Offset<fb::ActiveRollout>> active;
  active.reserve(s.active.size());
  for (const auto& [id, rollout] : s.active) {
    auto rid = b.CreateString(id);
    auto version = EncVersion(b, rollout.version);
    active.push_back(fb::CreateActiveRollout(b, rid, version, rollout.lease_ms));
  }
  auto active_vec = b.CreateVector(active);
  Offset<fb::UpdatePlan> update;
  if (s.update) {
    const UpdatePlan& u = *s.update;
    auto update_id = b.CreateString(u.update_id);
    auto target = EncVersion(b, u.target);
    auto id = EncIdentity(b, u.identity);
    auto uri = b.CreateString(u.source_uri);
    auto reason = b.CreateString(u.abort_reason);
    auto expected = OptString(b, u.expected_digest);
    auto observed = EncDigest(b, u.observed_digest);
    auto memory = EncMemory(b, u.sleep_memory);
    update = fb::CreateUpdatePlan(b, update_id, target, id, uri, u.drain_seen, u.transfer_started,
                                  u.caches_reset_mask, u.validated, u.aborting, reason, expected,
                                  observed, u.restore, u.adopt, u.sleep_level, u.wake_only,
                                  u.from_sleep, u.weights_awake, memory, u.wake_first, u.kv_awake);
  }
  Offset<fb::TaintRecord> taint;
  if (s.taint) {
    const TaintRecord& t = *s.taint;
    auto update_id = b.CreateString(t.update_id);
    auto target = EncVersion(b, t.target);
    auto detail = b.CreateString(t.detail);
    taint = fb::CreateTaintRecord(b, static_cast<fb::Lifecycle>(Fb(t.from)),
                                  static_cast<fb::Cause>(Fb(t.cause)), update_id, target, detail);
  }
  auto counters = EncCounters(b, s.counters);
  auto labels_vec = EncLabels(b, s.labels);
  auto instance = b.CreateString(s.engine_instance);
  auto committed_digest = EncDigest(b, s.committed_digest);
  std::vector<Offset<fb::LabelDigest>> label_digests;
  label_digests.reserve(s.label_digests.size());
  for (const auto& [label, combined] : s.label_digests) {
    auto l = b.CreateString(label);
    auto c = b.CreateString(combined);
    label_digests.push_back(fb::CreateLabelDigest(b, l, c));
  }
  auto label_digests_vec = b.CreateVector(label_digests);
  return fb::CreateState(b, static_cast<fb::Lifecycle>(Fb(s.lifecycle)), committed, committed_id,
                         bootstrap, s.attempts, in_flight, active_vec, update, taint, counters,
                         instance, s.engine_reachable, s.engine_recheck, labels_vec,
                         /*labels_complete=*/true, committed_digest, label_digests_vec,
                         s.sleep_level, s.fold_rules);
}

// A snapshot written before the label registry existed knows only the committed label; labels
// committed earlier in such a journal are then not guarded against reuse.
void DecLabels(Decoder& d, const fb::State* t, State& s) {
  if (!t->labels_complete()) {
    if (s.lifecycle != Lifecycle::kUninitialized)
      s.labels[s.committed.label] = s.committed_identity;
    return;
  }
  DecLabelMap(d, t->labels(), s.labels);
}

State DecStateTable(Decoder& d, const fb::State* t) {
  State s;
  s.lifecycle = d.Enum<Lifecycle>(t->lifecycle(), kLifecycleMax, "State.lifecycle");
  s.committed = DecVersion(t->committed());
  s.committed_identity = DecIdentity(t->committed_identity());
  if (const auto* boot = t->bootstrap()) {
    s.bootstrap = DecBootstrap(d, boot, "State.bootstrap.fold_rules");
  }
  s.fold_rules = d.FoldRules(t->fold_rules(), "State.fold_rules");
  s.attempts = t->attempts();
  if (const auto* e = t->in_flight()) {
    s.in_flight = Effect{d.Enum<EffectKind>(e->kind(), kEffectKindMaxRaw, "State.in_flight.kind"),
                         d.Enum<CacheKind>(e->cache(), kCacheMaxRaw, "State.in_flight.cache"),
                         d.Enum<WakeTag>(e->wake(), kWakeTagMax, "State.in_flight.wake")};
  }
  if (const auto* active = t->active()) {
    for (const fb::ActiveRollout* r : *active) {
      if (r == nullptr) continue;
      auto [it, inserted] = s.active.emplace(
          Str(r->rollout_id()), ActiveRollout{DecVersion(r->version()), r->lease_ms()});
      if (!inserted && d.error.empty()) d.error = "duplicate active rollout " + Quote(it->first);
    }
  }
  if (const auto* u = t->update()) {
    UpdatePlan p;
    p.update_id = Str(u->update_id());
    p.target = DecVersion(u->target());
    p.identity = DecIdentity(u->identity());
    p.source_uri = Str(u->source_uri());
    p.drain_seen = u->drain_seen();
    p.transfer_started = u->transfer_started();
    p.caches_reset_mask = u->caches_reset_mask();
    p.validated = u->validated();
    p.aborting = u->aborting();
    p.abort_reason = Str(u->abort_reason());
    p.expected_digest = Str(u->expected_digest());
    p.observed_digest = DecDigest(u->observed_digest());
    p.restore = u->restore();
    p.adopt = u->adopt();
    p.sleep_level = u->sleep_level();
    p.wake_only = u->wake_only();
    p.from_sleep = u->from_sleep();
    p.weights_awake = u->weights_awake();
    p.sleep_memory = DecMemory(u->sleep_memory());
    p.wake_first = u->wake_first();
    p.kv_awake = u->kv_awake();
    s.update = std::move(p);
  }
  if (const auto* x = t->taint()) {
    s.taint = TaintRecord{d.Enum<Lifecycle>(x->from(), kLifecycleMax, "State.taint.from"),
                          d.Enum<Cause>(x->cause(), kCauseMax, "State.taint.cause"),
                          Str(x->update_id()), DecVersion(x->target()), Str(x->detail())};
  }
  if (const auto* c = t->counters()) s.counters = DecCounters(*c);
  s.engine_instance = Str(t->engine_instance());
  s.engine_reachable = t->engine_reachable();
  s.engine_recheck = t->engine_recheck();
  DecLabels(d, t, s);
  s.committed_digest = DecDigest(t->committed_digest());
  s.sleep_level = t->sleep_level();
  if (const auto* digests = t->label_digests()) {
    for (const fb::LabelDigest* l : *digests) {
      if (l == nullptr) continue;
      auto [it, inserted] = s.label_digests.emplace(Str(l->label()), Str(l->combined()));
      if (!inserted && d.error.empty()) d.error = "duplicate label digest " + Quote(it->first);
    }
  }
  return s;
}

// ---- the fold's rules on a decoded State ----
//
// A snapshot holds what the fold made of events it checked, so each of its strings passed the
// check the fold applied to the event that carried it. Stored bytes need not (a hostile or buggy
// writer hashes whatever it stores), and a State's strings reach the decisions derived from it:
// RecoveryStarted abandons every active rollout by its id, and a decision the fold refuses stops
// the process. So each field is checked here as the fold checked its source
// (statemachine/lifecycle.cc), and a failure is Corruption naming the field.

// The fold's refusal of a stored field, as Corruption naming where the field was found.
Status Corrupt(const std::string& where, const Status& st) {
  return st.ok() ? st : Status::Corruption(where + ": " + st.message());
}

// Free text the executor recorded (a transition's detail, an engine's instance): the fold bounds
// its length and nothing more (statemachine's check_text); every reader escapes it on output.
Status CheckFreeText(const char* what, const std::string& s) {
  if (s.size() <= kTextBytesMax) return Status::OK();
  return Status::InvalidArgument(std::string(what) + " exceeds " + std::to_string(kTextBytesMax) +
                                 " bytes");
}

// In UNINITIALIZED nothing is committed and the defaults stand; from the bootstrap on, the version
// and identity are a bootstrap's or a published update's. The digest is a probe's or a
// validation's, recorded from the bootstrap probe on.
Status CheckCommitted(const State& s) {
  const bool none = s.lifecycle == Lifecycle::kUninitialized && s.committed == WeightVersion{} &&
                    s.committed_identity == WeightIdentity{};
  if (!none) {
    RC_RETURN_IF_ERROR(Corrupt("committed", check_id("label", s.committed.label)));
    RC_RETURN_IF_ERROR(Corrupt("committed", check_weight_identity(s.committed_identity)));
  }
  RC_RETURN_IF_ERROR(Corrupt("committed", check_weight_digest(s.committed_digest)));
  return Corrupt("engine", CheckFreeText("engine_instance", s.engine_instance));
}

// A label registry (an engine's or the fleet's): each label and the identity a bootstrap, an
// update or a fleet update named with it.
Status CheckLabelMap(const std::map<std::string, WeightIdentity>& labels) {
  for (const auto& [label, identity] : labels) {
    Status st = check_id("label", label);
    if (st.ok()) st = check_weight_identity(identity);
    if (!st.ok()) return Corrupt("label " + Quote(label), st);
  }
  return Status::OK();
}

// A committed label's combined digest, recorded only when the engine computed one (never empty).
Status CheckLabelDigests(const std::map<std::string, std::string>& digests) {
  for (const auto& [label, combined] : digests) {
    Status st = check_id("label", label);
    if (st.ok()) st = check_digest("combined digest", combined, true);
    if (!st.ok()) return Corrupt("label digest " + Quote(label), st);
  }
  return Status::OK();
}

Status CheckBootstrap(const BootstrapRequested& b) {
  RC_RETURN_IF_ERROR(check_id("label", b.label));
  RC_RETURN_IF_ERROR(check_weight_identity(b.identity));
  return check_digest("expected_digest", b.expected_digest, false);
}

// A binding as RolloutAdmitted carried it: its version is the committed one it was bound to.
Status CheckRollout(const std::string& id, const ActiveRollout& r) {
  RC_RETURN_IF_ERROR(check_id("rollout_id", id));
  RC_RETURN_IF_ERROR(check_id("version label", r.version.label));
  if (r.lease_ms > kLeaseMsMax) {
    return Status::InvalidArgument("lease_ms exceeds " + std::to_string(kLeaseMsMax));
  }
  return Status::OK();
}

// A plan as its request was checked (an update's; a restore's, sleep's or wake-up's names a
// registered label or the committed version), and what its observations recorded into it.
Status CheckPlan(const UpdatePlan& u) {
  RC_RETURN_IF_ERROR(check_id("update_id", u.update_id));
  RC_RETURN_IF_ERROR(check_id("target label", u.target.label));
  RC_RETURN_IF_ERROR(check_weight_identity(u.identity));
  RC_RETURN_IF_ERROR(check_client_text("source_uri", u.source_uri));
  RC_RETURN_IF_ERROR(check_digest("expected_digest", u.expected_digest, false));
  RC_RETURN_IF_ERROR(check_weight_digest(u.observed_digest));
  RC_RETURN_IF_ERROR(CheckFreeText("abort_reason", u.abort_reason));
  if ((u.caches_reset_mask | kAllCachesMask) != kAllCachesMask) {
    return Status::InvalidArgument("caches_reset_mask " + std::to_string(u.caches_reset_mask) +
                                   " has a bit of no cache kind");
  }
  return check_device_memory(u.sleep_memory);
}

// A taint names its plan's id and target, or no id and the committed version (the engine's own).
Status CheckTaint(const TaintRecord& t) {
  if (!t.update_id.empty()) RC_RETURN_IF_ERROR(check_id("update_id", t.update_id));
  RC_RETURN_IF_ERROR(check_id("target label", t.target.label));
  return CheckFreeText("detail", t.detail);
}

// Every string of a decoded State (its collections' sizes are bounded before decoding).
Status CheckStateFields(const State& s) {
  RC_RETURN_IF_ERROR(CheckCommitted(s));
  RC_RETURN_IF_ERROR(CheckLabelMap(s.labels));
  RC_RETURN_IF_ERROR(CheckLabelDigests(s.label_digests));
  if (s.bootstrap) RC_RETURN_IF_ERROR(Corrupt("bootstrap", CheckBootstrap(*s.bootstrap)));
  for (const auto& [id, rollout] : s.active) {
    if (Status st = CheckRollout(id, rollout); !st.ok()) {
      return Corrupt("active rollout " + Quote(id), st);
    }
  }
  if (s.update) RC_RETURN_IF_ERROR(Corrupt("update plan", CheckPlan(*s.update)));
  if (s.taint) RC_RETURN_IF_ERROR(Corrupt("taint", CheckTaint(*s.taint)));
  return Status::OK();
}

}  // namespace

namespace {

// A snapshot's framing: the finished flatbuffer followed by its SHA-256.
std::string FinishHashed(FlatBufferBuilder& b) {
  std::string out = Finish(b);
  const Hash h = Sha256(out);
  out.append(reinterpret_cast<const char*>(h.data()), h.size());
  return out;
}

// The flatbuffer of a snapshot of at most `bound` bytes whose trailing SHA-256 matches; `what`
// names the snapshot in errors.
Result<std::string_view> SnapshotBody(std::string_view bytes, std::size_t bound,
                                      const std::string& what) {
  if (bytes.size() > bound) {
    return Status::Corruption(what + " of " + std::to_string(bytes.size()) +
                              " bytes exceeds the bound of " + std::to_string(bound));
  }
  if (bytes.size() < 8 + 32) {
    return Status::Corruption(what + " truncated: " + std::to_string(bytes.size()) + " bytes");
  }
  const std::string_view body = bytes.substr(0, bytes.size() - 32);
  const Hash want = Sha256(body);
  if (std::memcmp(want.data(), bytes.data() + body.size(), 32) != 0) {
    return Status::Corruption(what + " hash mismatch (stored bytes altered)");
  }
  return body;
}

}  // namespace

std::string EncodeState(const State& state) {
  FlatBufferBuilder b(1024 + state.active.size() * 96);
  b.Finish(EncState(b, state));
  return FinishHashed(b);
}

Result<State> DecodeState(std::string_view bytes) {
  Result<std::string_view> framed = SnapshotBody(bytes, kStateBytesMax, "snapshot");
  if (!framed.ok()) return framed.status();
  const std::string_view body = *framed;
  AlignedCopy copy(body);
  flatbuffers::Verifier::Options options;
  options.max_depth = kVerifierDepthMax;
  // A snapshot holds two tables per active rollout.
  options.max_tables = kVerifierTablesMax + 2 * static_cast<std::uint32_t>(kActiveRolloutsMax) +
                       3 * static_cast<std::uint32_t>(kLabelsMax) +
                       2 * static_cast<std::uint32_t>(kTensorDigestsMax);
  flatbuffers::Verifier verifier(copy.data(), body.size(), options);
  if (!verifier.VerifyBuffer<fb::State>(nullptr)) {
    return Status::Corruption("snapshot fails FlatBuffers verification");
  }
  const auto* t = flatbuffers::GetRoot<fb::State>(copy.data());
  if (t->active() != nullptr && t->active()->size() > kActiveRolloutsMax) {
    return Status::Corruption("snapshot has more than " + std::to_string(kActiveRolloutsMax) +
                              " active rollouts");
  }
  if (t->labels() != nullptr && t->labels()->size() > kLabelsMax) {
    return Status::Corruption("snapshot has more than " + std::to_string(kLabelsMax) + " labels");
  }
  if (t->label_digests() != nullptr && t->label_digests()->size() > kLabelsMax) {
    return Status::Corruption("snapshot has more than " + std::to_string(kLabelsMax) +
                              " label digests");
  }
  Decoder d;
  State s = DecStateTable(d, t);
  if (!d.error.empty()) return Status::Corruption("snapshot: " + d.error);
  if (Status st = CheckStateFields(s); !st.ok()) {
    return Status::Corruption("snapshot: " + st.message());
  }
  return s;
}

// ---- FleetState ----

namespace {

using FleetTable = fb::FleetSnapshotState;
constexpr auto kMemberStatusMax = static_cast<std::uint8_t>(MemberStatus::kStalled);

// Each engine as its own snapshot bytes (EncodeState), so DecodeState bounds and checks it.
Offset<flatbuffers::Vector<Offset<fb::FleetEngineState>>> EncEngines(
    FlatBufferBuilder& b, const std::map<std::string, State>& engines) {
  std::vector<Offset<fb::FleetEngineState>> out;
  out.reserve(engines.size());
  for (const auto& [name, state] : engines) {
    const std::string bytes = EncodeState(state);
    auto n = b.CreateString(name);
    auto st = b.CreateVector(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
    out.push_back(fb::CreateFleetEngineState(b, n, st));
  }
  return b.CreateVector(out);
}

Offset<flatbuffers::Vector<Offset<fb::LabelGeneration>>> EncGenerations(
    FlatBufferBuilder& b, const std::map<std::string, std::uint64_t>& generations) {
  std::vector<Offset<fb::LabelGeneration>> out;
  out.reserve(generations.size());
  for (const auto& [label, generation] : generations) {
    auto l = b.CreateString(label);
    out.push_back(fb::CreateLabelGeneration(b, l, generation));
  }
  return b.CreateVector(out);
}

// No table for no open fleet update.
Offset<fb::FleetUpdateState> EncFleetUpdateState(FlatBufferBuilder& b,
                                                 const std::optional<FleetUpdate>& u) {
  if (!u) return {};
  auto request = EncFleetUpdateRequest(b, u->request);
  std::vector<Offset<fb::FleetMember>> members;
  members.reserve(u->members.size());
  for (const auto& [engine, status] : u->members) {
    auto e = b.CreateString(engine);
    members.push_back(fb::CreateFleetMember(b, e, static_cast<std::uint8_t>(status)));
  }
  auto members_vec = b.CreateVector(members);
  auto cancelled = u->cancelled ? b.CreateString(*u->cancelled) : Offset<flatbuffers::String>();
  return fb::CreateFleetUpdateState(b, request, members_vec, cancelled, u->cancelled.has_value());
}

// What a writer of each generation stored beside the fold itself.
struct FleetExtras {
  bool with_removed = true;
  const Hash* chain_hash = nullptr;  // nullptr: none (before v9)
};

Offset<FleetTable> EncFleet(FlatBufferBuilder& b, const FleetState& f, std::uint64_t events,
                            const FleetExtras& extras) {
  auto engines = EncEngines(b, f.engines);
  auto leaving = b.CreateVectorOfStrings(f.leaving.begin(), f.leaving.end());
  auto policy = EncPolicy(b, f.policy);
  auto generations = EncGenerations(b, f.label_generation);
  auto labels = EncLabels(b, f.labels);
  auto update = EncFleetUpdateState(b, f.update);
  auto removed = extras.with_removed ? EncCounters(b, f.removed) : Offset<fb::Counters>();
  auto chain_hash = extras.chain_hash == nullptr
                        ? Offset<flatbuffers::Vector<std::uint8_t>>()
                        : b.CreateVector(extras.chain_hash->data(), extras.chain_hash->size());
  return fb::CreateFleetSnapshotState(b, events, engines, leaving, policy, generations, labels,
                                      f.next_generation, f.named, update, f.fleet_updates_ended,
                                      removed, chain_hash);
}

// Stored bytes that break one of the fold's rules are corrupt, not a bad request.
Status AsCorruption(const Status& st) { return st.ok() ? st : Status::Corruption(st.message()); }

// An engine is named by an id, or is "" (the one unnamed engine of a journal).
Status CheckEngineName(const char* what, const std::string& name) {
  return name.empty() ? Status::OK() : AsCorruption(check_id(what, name));
}

template <class V>
Status CheckCount(const V* v, std::size_t max, const char* what) {
  if (v == nullptr || v->size() <= max) return Status::OK();
  return Status::Corruption("more than " + std::to_string(max) + " " + what);
}

std::string_view Bytes(const flatbuffers::Vector<std::uint8_t>* v) {
  return v == nullptr ? std::string_view()
                      : std::string_view(reinterpret_cast<const char*>(v->data()), v->size());
}

Status DecEngines(const FleetTable* t, FleetState& f) {
  RC_RETURN_IF_ERROR(CheckCount(t->engines(), kFleetEnginesMax, "engines"));
  if (t->engines() == nullptr) return Status::OK();
  for (const fb::FleetEngineState* e : *t->engines()) {
    if (e == nullptr) return Status::Corruption("an engine entry is missing");
    const std::string name = Str(e->name());
    RC_RETURN_IF_ERROR(CheckEngineName("engine name", name));
    if (f.engines.count(name) != 0) return Status::Corruption("duplicate engine '" + name + "'");
    Result<State> state = DecodeState(Bytes(e->state()));
    if (!state.ok())
      return Status::Corruption("engine '" + name + "': " + state.status().message());
    f.engines.emplace(name, std::move(state.value()));
  }
  return Status::OK();
}

Status DecLeaving(const FleetTable* t, FleetState& f) {
  RC_RETURN_IF_ERROR(CheckCount(t->leaving(), kFleetEnginesMax, "leaving engines"));
  if (t->leaving() == nullptr) return Status::OK();
  for (const flatbuffers::String* s : *t->leaving()) {
    const std::string name = Str(s);
    RC_RETURN_IF_ERROR(AsCorruption(check_id("leaving engine", name)));
    if (!f.leaving.insert(name).second) {
      return Status::Corruption("engine '" + name + "' is leaving twice");
    }
  }
  return Status::OK();
}

// The fold's bounds on a FleetConfigured; an absent policy is the default one.
Status DecPolicy(const FleetTable* t, FleetState& f) {
  if (const fb::FleetConfigured* p = t->policy()) {
    f.policy = FleetConfigured{p->staleness_max(), p->min_serving()};
  }
  if (f.policy.staleness_max > kFleetStalenessMax || f.policy.min_serving > kFleetEnginesMax) {
    return Status::Corruption("policy out of range (staleness_max " +
                              std::to_string(f.policy.staleness_max) + ", min_serving " +
                              std::to_string(f.policy.min_serving) + ")");
  }
  return Status::OK();
}

Status DecGenerations(const FleetTable* t, FleetState& f) {
  RC_RETURN_IF_ERROR(CheckCount(t->label_generations(), kLabelsMax, "label generations"));
  if (t->label_generations() == nullptr) return Status::OK();
  for (const fb::LabelGeneration* g : *t->label_generations()) {
    if (g == nullptr) return Status::Corruption("a label generation is missing");
    const std::string label = Str(g->label());
    RC_RETURN_IF_ERROR(AsCorruption(check_id("generation label", label)));
    if (!f.label_generation.emplace(label, g->generation()).second) {
      return Status::Corruption("duplicate label generation '" + label + "'");
    }
  }
  return Status::OK();
}

// The fleet's label registry: one identity per label, as the fold checked each when it came.
Status DecFleetLabels(const FleetTable* t, FleetState& f) {
  RC_RETURN_IF_ERROR(CheckCount(t->labels(), kLabelsMax, "labels"));
  Decoder d;
  DecLabelMap(d, t->labels(), f.labels);
  if (!d.error.empty()) return Status::Corruption(d.error);
  return CheckLabelMap(f.labels);
}

// The bounds the fold checked when it took the FleetUpdateRequested.
Status CheckFleetRequest(const FleetUpdateRequested& r) {
  RC_RETURN_IF_ERROR(AsCorruption(check_id("update_id", r.update_id)));
  RC_RETURN_IF_ERROR(AsCorruption(check_id("target_label", r.target_label)));
  if (r.batch_max == 0 || r.batch_max > kFleetEnginesMax || r.min_healthy > kFleetEnginesMax) {
    return Status::Corruption("fleet update batch_max or min_healthy out of range");
  }
  RC_RETURN_IF_ERROR(AsCorruption(check_client_text("source_uri", r.source_uri)));
  RC_RETURN_IF_ERROR(AsCorruption(check_weight_identity(r.identity)));
  return AsCorruption(check_digest("expected_digest", r.expected_digest, false));
}

Status DecMembers(const fb::FleetUpdateState* u, FleetUpdate& out) {
  RC_RETURN_IF_ERROR(CheckCount(u->members(), kFleetEnginesMax, "fleet update members"));
  if (u->members() == nullptr) return Status::OK();
  Decoder d;
  for (const fb::FleetMember* m : *u->members()) {
    if (m == nullptr) return Status::Corruption("a fleet update member is missing");
    const std::string engine = Str(m->engine());
    RC_RETURN_IF_ERROR(CheckEngineName("member engine", engine));
    const auto status = d.Enum<MemberStatus>(m->status(), kMemberStatusMax, "FleetMember.status");
    if (!d.error.empty()) return Status::Corruption(d.error);
    if (!out.members.emplace(engine, status).second) {
      return Status::Corruption("duplicate fleet update member '" + engine + "'");
    }
  }
  return Status::OK();
}

Status DecCancelled(const fb::FleetUpdateState* u, FleetUpdate& out) {
  if (!u->has_cancelled()) {
    if (u->cancelled() == nullptr) return Status::OK();
    return Status::Corruption("a cancel reason without has_cancelled");
  }
  std::string reason = Str(u->cancelled());
  if (reason.size() > kFleetCancelReasonBytesMax || !text::printable_utf8(reason)) {
    return Status::Corruption("cancel reason over " + std::to_string(kFleetCancelReasonBytesMax) +
                              " bytes or unprintable");
  }
  out.cancelled = std::move(reason);
  return Status::OK();
}

Status DecFleetUpdate(const FleetTable* t, FleetState& f) {
  const fb::FleetUpdateState* u = t->update();
  if (u == nullptr) return Status::OK();
  if (u->request() == nullptr) return Status::Corruption("fleet update without its request");
  FleetUpdate out;
  Decoder d;
  out.request = DecFleetUpdateRequest(d, u->request());
  if (!d.error.empty()) return Status::Corruption(d.error);
  RC_RETURN_IF_ERROR(CheckFleetRequest(out.request));
  RC_RETURN_IF_ERROR(DecMembers(u, out));
  RC_RETURN_IF_ERROR(DecCancelled(u, out));
  f.update = std::move(out);
  return Status::OK();
}

// What check_fleet_invariants leaves to the fold's history: the unnamed engine exists only in a
// fleet nobody joined, and no engine applied more events than the fleet did.
Status CheckFleetCounts(const FleetState& f, std::uint64_t events) {
  std::uint64_t engine_events = 0;
  for (const auto& [name, s] : f.engines) {
    if (name.empty() == f.named) {
      return Status::Corruption(f.named ? "the unnamed engine in a fleet engines joined"
                                        : "a named engine in a fleet nobody joined");
    }
    if (s.counters.events > events - engine_events) {
      return Status::Corruption("engines applied more events than the fleet's " +
                                std::to_string(events));
    }
    engine_events += s.counters.events;
  }
  if (!f.named && f.removed != Counters{}) {
    return Status::Corruption("removed engines' counters in a fleet nobody joined");
  }
  if (f.removed.events > events - engine_events) {
    return Status::Corruption("removed engines applied more events than the fleet's " +
                              std::to_string(events));
  }
  return Status::OK();
}

// Absent in a snapshot from before v9; present, it is exactly one SHA-256.
Status DecChainHash(const FleetTable* t, FleetSnapshot& out) {
  const flatbuffers::Vector<std::uint8_t>* v = t->chain_hash();
  if (v == nullptr) return Status::OK();
  Hash hash{};
  if (v->size() != hash.size()) {
    return Status::Corruption("chain hash of " + std::to_string(v->size()) + " bytes, not " +
                              std::to_string(hash.size()));
  }
  std::memcpy(hash.data(), v->data(), hash.size());
  out.chain_hash = hash;
  return Status::OK();
}

Result<FleetSnapshot> DecFleetTable(const FleetTable* t) {
  FleetSnapshot out;
  out.events = t->events();
  FleetState& f = out.fleet;
  RC_RETURN_IF_ERROR(DecEngines(t, f));
  RC_RETURN_IF_ERROR(DecLeaving(t, f));
  RC_RETURN_IF_ERROR(DecPolicy(t, f));
  RC_RETURN_IF_ERROR(DecGenerations(t, f));
  RC_RETURN_IF_ERROR(DecFleetLabels(t, f));
  RC_RETURN_IF_ERROR(DecFleetUpdate(t, f));
  f.next_generation = t->next_generation();
  f.named = t->named();
  f.fleet_updates_ended = t->fleet_updates_ended();
  out.counts_removed = t->removed() != nullptr;
  if (out.counts_removed) f.removed = DecCounters(*t->removed());
  RC_RETURN_IF_ERROR(DecChainHash(t, out));
  f.events = out.events;
  RC_RETURN_IF_ERROR(CheckFleetCounts(f, out.events));
  if (std::string bad = check_fleet_invariants(f); !bad.empty()) {
    return Status::Corruption("fleet invariant broken: " + bad);
  }
  return out;
}

}  // namespace

std::string EncodeFleetState(const FleetState& fleet, std::uint64_t events,
                             const Hash& chain_hash) {
  FlatBufferBuilder b(4096);
  b.Finish(EncFleet(b, fleet, events, FleetExtras{true, &chain_hash}));
  return FinishHashed(b);
}

std::string EncodeFleetState(const FleetState& fleet, std::uint64_t events) {
  FlatBufferBuilder b(4096);
  b.Finish(EncFleet(b, fleet, events, FleetExtras{true, nullptr}));
  return FinishHashed(b);
}

std::string EncodeFleetStateWithoutRemoved(const FleetState& fleet, std::uint64_t events) {
  FlatBufferBuilder b(4096);
  b.Finish(EncFleet(b, fleet, events, FleetExtras{false, nullptr}));
  return FinishHashed(b);
}

Result<FleetSnapshot> DecodeFleetState(std::string_view bytes) {
  Result<std::string_view> body = SnapshotBody(bytes, kFleetStateBytesMax, "fleet snapshot");
  if (!body.ok()) return body.status();
  AlignedCopy copy(*body);
  flatbuffers::Verifier::Options options;
  options.max_depth = kVerifierDepthMax;
  // Engines are nested bytes, not tables: two tables per engine (its entry, its member entry),
  // three per label (generation, label, identity).
  options.max_tables = kVerifierTablesMax + 2 * static_cast<std::uint32_t>(kFleetEnginesMax) +
                       3 * static_cast<std::uint32_t>(kLabelsMax);
  flatbuffers::Verifier verifier(copy.data(), body->size(), options);
  if (!verifier.VerifyBuffer<FleetTable>(nullptr)) {
    return Status::Corruption("fleet snapshot fails FlatBuffers verification");
  }
  Result<FleetSnapshot> out = DecFleetTable(flatbuffers::GetRoot<FleetTable>(copy.data()));
  if (!out.ok()) return Status::Corruption("fleet snapshot: " + out.status().message());
  return out;
}

}  // namespace rc::journal
