export default function Home() {
  return (
    <main>
      <h1>Hello from Next.js</h1>
    </main>
  )
}
