import Counter from './counter.jsx'

export default function Home() {
  return (
    <main>
      <h1>Hello from Next.js</h1>
      <Counter />
    </main>
  )
}
