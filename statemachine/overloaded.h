// std::visit with a set of lambdas: Overloaded{[](const A&) {...}, [](const auto&) {...}}.
#pragma once

namespace rc {

template <class... Ts>
struct Overloaded : Ts... {
  using Ts::operator()...;
};
template <class... Ts>
Overloaded(Ts...) -> Overloaded<Ts...>;

}  // namespace rc
