// A dependency-free HTTP server. In the sandbox there is no network: the
// broker reaches the app through the Unix socket named by PREVIEW_SOCKET.
const http = require('node:http')
const fs = require('node:fs')

const server = http.createServer((req, res) => {
  res.on('finish', () => {
    console.log(`${req.method} ${req.url} -> ${res.statusCode}`)
  })
  res.setHeader('Content-Type', 'text/html; charset=utf-8')
  res.end('<!doctype html><h1>Hello from Node.js</h1>\n')
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
