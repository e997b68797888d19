# A first call from Elixir, as an application sees it: one case per VM (the kernel modules are
# per process), printing one line of seconds: the NIF's GPU context (`info/0`), and the case.
#
#   backbone KIND   Backbone.load (:cuda; ExPhil's sizes), then the first window, then the
#                   first frame (each timed; the engine compiles its programs at load, side
#                   by side, see engine/prefetch.rs)
#   warmup KIND     Backbone.load, then FusedKernels.warmup(handle) (window + frame)
#   warmup_ops OPS  FusedKernels.warmup([ops...]) (comma-separated op names)
#
# Usage: mix run --no-compile bench/first_call.exs CASE ARG
# (--no-compile: `mix compile` would pre-fill the kernel cache first, see bench/gpu/first_call_mix.sh)
alias FusedKernels.Backbone
alias FusedKernels.Backbone.Spec

secs = fn f ->
  t = System.monotonic_time()
  r = f.()
  {System.convert_time_unit(System.monotonic_time() - t, :native, :microsecond) / 1.0e6, r}
end

fmt = fn s -> :erlang.float_to_binary(s, decimals: 3) end

{ctx, info} = secs.(fn -> FusedKernels.info() end)

unless info[:cuda_available] do
  IO.puts("no GPU: #{inspect(info, limit: 8)}")
  System.halt(2)
end

[kase, arg] = System.argv()

{what, stats} =
  case kase do
    k when k in ["backbone", "warmup"] ->
      spec = Spec.new(String.to_existing_atom(arg))
      params = Backbone.random_params(spec, 1)
      {load, h} = secs.(fn -> Backbone.load(spec, params, backend: :cuda) end)

      if k == "warmup" do
        {w, :ok} = secs.(fn -> FusedKernels.warmup(h) end)
        {"load #{fmt.(load)} warmup #{fmt.(w)} total #{fmt.(load + w)}", FusedKernels.info()}
      else
        window =
          {:binary.copy(<<0.5::float-32-native>>, spec.window * spec.embed),
           {1, spec.window, spec.embed}, {:f, 32}}

        frame = {:binary.copy(<<0.5::float-32-native>>, spec.embed), {1, spec.embed}, {:f, 32}}
        {win, _} = secs.(fn -> Backbone.predict(h, window) end)
        state = Backbone.init_state(h, 1)
        {fr, _} = secs.(fn -> Backbone.step(h, state, frame) end)

        {"load #{fmt.(load)} window #{fmt.(win)} frame #{fmt.(fr)} total #{fmt.(load + win + fr)}",
         FusedKernels.info()}
      end

    "warmup_ops" ->
      ops = arg |> String.split(",") |> Enum.map(&String.to_existing_atom/1)
      {w, :ok} = secs.(fn -> FusedKernels.warmup(ops) end)
      {"warmup #{fmt.(w)}", FusedKernels.info()}
  end

IO.puts("#{kase} #{arg}: context #{fmt.(ctx)} #{what} #{inspect(stats[:kernel_cache])}")
