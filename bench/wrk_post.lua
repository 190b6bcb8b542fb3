-- wrk script: POST the body in args[1] with the headers in args[2..], and print the results
-- as one line of JSON ("WRK_JSON {...}") for bench/run.py.
--   wrk -t1 -c64 -d3s -s bench/wrk_post.lua http://127.0.0.1:8080/v1/chat/completions -- body.json "authorization: Bearer k"

function init(args)
   local f = assert(io.open(args[1], "rb"))
   wrk.method = "POST"
   wrk.body = f:read("*a")
   f:close()
   wrk.headers["Content-Type"] = "application/json"
   for i = 2, #args do
      local name, value = args[i]:match("^([^:]+):%s*(.*)$")
      wrk.headers[name] = value
   end
end

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'WRK_JSON {"requests":%d,"duration_us":%d,"bytes":%d,"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
      '"latency_us":{"p50":%d,"p99":%d,"max":%d,"mean":%.1f}}\n',
      summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
      latency:percentile(50), latency:percentile(99), latency.max, latency.mean))
end
