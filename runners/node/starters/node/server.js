// A dependency-free HTTP server. In the sandbox there is no network: the
// broker reaches the app through the Unix socket named by PREVIEW_SOCKET.
const http = require('node:http')
const fs = require('node:fs')

// The page's own script makes the button count.
const page = `<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>Node.js App</title></head>
<body>
<main>
<h1>Hello from Node.js</h1>
<button type="button" id="counter">count is 0</button>
</main>
<script>
let count = 0
const button = document.getElementById('counter')
button.addEventListener('click', () => { button.textContent = 'count is ' + ++count })
</script>
</body>
</html>
`

const server = http.createServer((req, res) => {
  res.on('finish', () => {
    console.log(`${req.method} ${req.url} -> ${res.statusCode}`)
  })
  res.setHeader('Content-Type', 'text/html; charset=utf-8')
  res.end(page)
})

const socket = process.env.PREVIEW_SOCKET
if (socket) {
  try {
    fs.unlinkSync(socket) // a stale socket from an earlier run
  } catch {}
  server.listen(socket, () => console.log(`listening on ${socket}`))
} else {
  const port = Number(process.env.PORT) || 3000
  server.listen(port, () => console.log(`listening on port ${port}`))
}
